//! A shared record's value is its row as JSON, whichever endpoint keeps it.

use crate::store::StoreError;

pub fn encode(row: &impl serde::Serialize) -> bytes::Bytes {
    serde_json::to_vec(row).expect("a row is plain data").into()
}

pub fn decode<T: serde::de::DeserializeOwned>(value: &[u8]) -> Result<T, StoreError> {
    serde_json::from_slice(value).map_err(|e| StoreError::Corrupt(format!("a shared record: {e}")))
}
