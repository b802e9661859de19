//! How the `body` columns hold a document: JSON text, or on SQLite LZ4-compressed JSON (pure).
//!
//! A report's body is ~9 KB of very repetitive JSON. PostgreSQL compresses such values itself
//! (TOAST, LZ4 since `m20261125_000006_lz4_bodies`); SQLite stores a value as it is given, so
//! a body filled three 4 KB overflow pages and bodies were most of an SQLite store (16 KB a
//! report for 9.2 KB of JSON). On SQLite the store therefore writes each body compressed with
//! LZ4 — ~1.6 KB, fitting in the row's own page, compressed in tens of microseconds and
//! decompressed at several GB/s, so lists still cost about what copying the text cost. MySQL
//! keeps text: its `LONGTEXT` column takes no binary values, and InnoDB offers compression of
//! its own (`ROW_FORMAT=COMPRESSED`).
//!
//! A compressed body starts with [`LZ4_TAG`], which no JSON text starts with (a body always
//! starts with `{`), so a reader takes either form: rows written before the change, and the
//! change log's empty "body is in `objects`" marker, stay text.

use sea_orm::{DbBackend, QueryResult};

use super::StoreError;

/// First byte of a compressed body; an LZ4 block with its uncompressed length prepended
/// (`lz4_flex`'s `compress_prepend_size`) follows.
pub(super) const LZ4_TAG: u8 = 0x01;

/// No stored body is larger than this once decompressed: a request body is limited far below
/// it, so a larger length read from a compressed body means the value is corrupt (and must not
/// make the server allocate that much).
const MAX_BODY_BYTES: usize = 1 << 30;

/// How bodies are written on a backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum BodyCodec {
    /// JSON text as it is (PostgreSQL compresses it itself, MySQL as configured).
    Text,
    /// [`LZ4_TAG`] and an LZ4 block (SQLite).
    Lz4,
}

impl BodyCodec {
    pub(super) fn of(backend: DbBackend) -> Self {
        match backend {
            DbBackend::Sqlite => BodyCodec::Lz4,
            _ => BodyCodec::Text,
        }
    }

    /// The value to store for the JSON text `json`. The empty text (the change log's marker)
    /// stays text on every backend.
    pub(super) fn encode(self, json: String) -> sea_orm::Value {
        match self {
            BodyCodec::Lz4 if !json.is_empty() => compress(json.as_bytes()).into(),
            _ => json.into(),
        }
    }

    /// The JSON text of column `column` of `row` (`None` when it is NULL); `what` names the
    /// object in errors.
    pub(super) fn decode_column(
        self,
        row: &QueryResult,
        column: &str,
        what: impl Fn() -> String,
    ) -> Result<Option<String>, StoreError> {
        match self {
            BodyCodec::Text => Ok(row.try_get::<Option<String>>("", column)?),
            // SQLite hands a TEXT value out as its bytes too, so both forms read as bytes.
            BodyCodec::Lz4 => row
                .try_get::<Option<Vec<u8>>>("", column)?
                .map(|stored| decode(stored).map_err(|why| StoreError::Corrupt(what(), why)))
                .transpose(),
        }
    }

    /// [`BodyCodec::decode_column`] of a NOT NULL column.
    pub(super) fn decode_required(
        self,
        row: &QueryResult,
        column: &str,
        what: impl Fn() -> String,
    ) -> Result<String, StoreError> {
        self.decode_column(row, column, &what)?
            .ok_or_else(|| StoreError::Corrupt(what(), format!("its {column} is NULL")))
    }
}

/// `json` as a compressed body.
pub(super) fn compress(json: &[u8]) -> Vec<u8> {
    let block = lz4_flex::compress_prepend_size(json);
    let mut stored = Vec::with_capacity(1 + block.len());
    stored.push(LZ4_TAG);
    stored.extend_from_slice(&block);
    stored
}

/// The JSON text of a stored body, compressed or not; why not when it is neither.
pub(super) fn decode(stored: Vec<u8>) -> Result<String, String> {
    let text = match stored.split_first() {
        Some((&LZ4_TAG, block)) => {
            let declared = block
                .get(..4)
                .map(|n| u32::from_le_bytes(n.try_into().expect("four bytes")) as usize);
            match declared {
                Some(n) if n <= MAX_BODY_BYTES => {
                    let text = lz4_flex::decompress_size_prepended(block)
                        .map_err(|e| format!("its compressed body does not decompress: {e}"))?;
                    if text.len() != n {
                        let got = text.len();
                        return Err(format!("its compressed body claims {n} bytes, holds {got}"));
                    }
                    text
                }
                Some(n) => return Err(format!("its compressed body claims {n} bytes")),
                None => return Err("its compressed body is truncated".into()),
            }
        }
        _ => stored,
    };
    String::from_utf8(text).map_err(|e| format!("its body is not UTF-8: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_report_body_shrinks_and_comes_back() {
        use reports_server_crds::fixtures::{Subject, pss_policy_report};
        let report = pss_policy_report(&Subject::pod("ns", 3), 1_700_000_000, &[1, 4]);
        let json = serde_json::to_string(&report).unwrap();
        let stored = compress(json.as_bytes());
        assert!(
            stored.len() * 3 < json.len(),
            "{} bytes compressed to {}",
            json.len(),
            stored.len()
        );
        assert_eq!(decode(stored).unwrap(), json);
    }

    #[test]
    fn text_bodies_are_read_as_they_are() {
        assert_eq!(decode(b"{\"a\":1}".to_vec()).unwrap(), "{\"a\":1}");
        assert_eq!(decode(Vec::new()).unwrap(), "");
    }

    #[test]
    fn the_change_log_marker_stays_text() {
        assert_eq!(
            BodyCodec::Lz4.encode(String::new()),
            sea_orm::Value::String(Some(String::new()))
        );
        assert!(matches!(
            BodyCodec::Lz4.encode("{}".into()),
            sea_orm::Value::Bytes(Some(b)) if b[0] == LZ4_TAG
        ));
        assert_eq!(
            BodyCodec::Text.encode("{}".into()),
            sea_orm::Value::String(Some("{}".into()))
        );
    }

    #[test]
    fn corrupt_bodies_are_errors_not_panics_or_huge_allocations() {
        let json = br#"{"kind":"PolicyReport","results":[1,1,1,1,1,1,1,1,1,1,1,1]}"#;
        let good = compress(json);
        assert!(decode(vec![LZ4_TAG]).unwrap_err().contains("truncated"));
        assert!(
            decode(vec![LZ4_TAG, 0xff, 0xff, 0xff, 0xff, 0])
                .unwrap_err()
                .contains("claims")
        );
        let mut cut = good.clone();
        cut.truncate(good.len() - 3);
        assert!(decode(cut).is_err());
        assert!(decode(vec![b'{', 0xff]).unwrap_err().contains("UTF-8"));
        // A declared length beyond what the block holds: the block decodes, short.
        let mut longer = good.clone();
        longer[1] += 1;
        assert!(decode(longer).unwrap_err().contains("holds"));
    }

    proptest! {
        #[test]
        fn any_text_survives_the_round_trip(text in ".*") {
            let stored = compress(text.as_bytes());
            prop_assert_eq!(decode(stored).unwrap(), text);
        }

        #[test]
        fn arbitrary_bytes_after_the_tag_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let mut stored = vec![LZ4_TAG];
            stored.extend(bytes);
            let _ = decode(stored);
        }
    }
}
