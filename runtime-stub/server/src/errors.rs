//! Errors as the OpenAI API shapes them: `{"error": {"message", "type",
//! "param", "code"}}` with the HTTP status that says whose mistake it was. A
//! user's mistake is never a 500.

use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// One API error.
#[derive(Clone, Debug, PartialEq)]
pub struct ApiError {
    pub status: u16,
    pub message: String,
    /// `invalid_request_error`, `authentication_error`, `not_found_error`,
    /// `overloaded_error`, `server_error`.
    pub kind: &'static str,
    /// The request field at fault, where one is.
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Seconds a client should wait before trying again (503).
    pub retry_after: Option<u64>,
}

impl ApiError {
    /// A 400 for a malformed or unsupported request.
    pub fn invalid(message: impl Into<String>, param: Option<String>) -> ApiError {
        ApiError { status: 400, message: message.into(), kind: "invalid_request_error", param, code: None, retry_after: None }
    }

    /// A 400 for a prompt longer than the context, with both numbers.
    pub fn too_long(tokens: usize, max: u64, param: &str) -> ApiError {
        ApiError {
            code: Some("context_length_exceeded"),
            ..ApiError::invalid(format!("prompt is too long: {tokens} tokens exceeds the maximum context length of {max} tokens"), Some(param.into()))
        }
    }

    pub fn unauthorized() -> ApiError {
        ApiError {
            status: 401,
            message: "missing or wrong API key: send `Authorization: Bearer <key>` with the key maxrun serve was started with".into(),
            kind: "authentication_error",
            param: None,
            code: Some("invalid_api_key"),
            retry_after: None,
        }
    }

    pub fn model_not_found(asked: &str, served: &str) -> ApiError {
        ApiError {
            status: 404,
            message: format!("the model `{asked}` does not exist here; this server serves `{served}`"),
            kind: "not_found_error",
            param: Some("model".into()),
            code: Some("model_not_found"),
            retry_after: None,
        }
    }

    /// A 404 for a response id the store does not hold (never stored,
    /// evicted, deleted, or from another replica or an earlier run).
    pub fn response_not_found(id: &str, param: Option<&str>) -> ApiError {
        ApiError {
            status: 404,
            message: format!("no stored response with id `{id}`: it was never stored (store: false), was evicted or deleted, or was made by another server or an earlier run; send the conversation as `input` instead"),
            kind: "not_found_error",
            param: param.map(str::to_string),
            code: Some(if param.is_some() { "previous_response_not_found" } else { "response_not_found" }),
            retry_after: None,
        }
    }

    pub fn not_found(path: &str) -> ApiError {
        ApiError { status: 404, message: format!("no route {path}; see docs/serving.md for the endpoints"), kind: "not_found_error", param: None, code: None, retry_after: None }
    }

    /// A 503 with `Retry-After`: the queue is full, or the model is still loading.
    pub fn overloaded(message: impl Into<String>, retry_after: u64) -> ApiError {
        ApiError { status: 503, message: message.into(), kind: "overloaded_error", param: None, code: Some("overloaded"), retry_after: Some(retry_after) }
    }

    /// A 500: the server's own failure, never a request's.
    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError { status: 500, message: message.into(), kind: "server_error", param: None, code: None, retry_after: None }
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut response = (status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            response.headers_mut().insert("retry-after", HeaderValue::from(s));
        }
        response
    }
}
