//! [`UserError`], a user's own error inside [`Error::User`](super::Error::User): its type
//! kept in this process, its text across processes.

use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

/// A user's own error inside [`Error::User`](super::Error::User): shared (`Clone`), compared by its text,
/// and serialized as its text (the original type does not cross processes).
#[derive(Clone)]
pub struct UserError(Arc<dyn std::error::Error + Send + Sync>);

impl UserError {
    /// Wraps the user's error `err`.
    pub(crate) fn new(err: Arc<dyn std::error::Error + Send + Sync>) -> Self {
        UserError(err)
    }

    /// The user's error, to downcast (`err.get_ref().downcast_ref::<MyError>()`); after
    /// a trip through a queue it is a plain text error.
    pub fn get_ref(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        &*self.0
    }
}

impl fmt::Debug for UserError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl fmt::Display for UserError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&*self.0, f)
    }
}

impl std::error::Error for UserError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}

impl PartialEq for UserError {
    fn eq(&self, other: &Self) -> bool {
        self.0.to_string() == other.0.to_string()
    }
}

impl Serialize for UserError {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        self.0.to_string().serialize(s)
    }
}

/// The text of a [`UserError`] that crossed a queue.
#[derive(Debug)]
struct UserText(String);

impl fmt::Display for UserText {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for UserText {}

impl<'de> Deserialize<'de> for UserError {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        Ok(UserError(Arc::new(UserText(String::deserialize(d)?))))
    }
}
