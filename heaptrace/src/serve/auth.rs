//! Who may read: the address rules (loopback by default; any other needs a token) and the
//! bearer token, compared in constant time.
use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr},
    path::Path,
};

use subtle::ConstantTimeEq;

use crate::error::{Error, Result};

/// The most bytes a token file may hold: a token is a line, not a document.
const TOKEN_FILE_MAX: u64 = 4096;

/// `--serve ADDR`: HOST:PORT, [V6]:PORT, or a port alone (on 127.0.0.1).
pub fn parse_addr(s: &str) -> std::result::Result<SocketAddr, String> {
    let s = s.trim();
    if let Ok(port) = s.parse::<u16>() {
        return Ok(SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), port));
    }
    s.parse::<SocketAddr>().map_err(|_| {
        format!("not an address: {s:?} (try 127.0.0.1:9464, [::1]:9464 or a port alone)")
    })
}

/// A secret every request must carry as `Authorization: Bearer TOKEN`.
#[derive(Clone)]
pub struct Token(Vec<u8>);

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(..)")
    }
}

impl Token {
    /// The first line of `path`, without its line end or surrounding blanks.
    pub fn read(path: &Path) -> Result<Token> {
        let bad = |reason: String| Error::Output {
            flag: "--serve-token-file",
            path: path.to_path_buf(),
            reason,
        };
        let meta = std::fs::metadata(path).map_err(|e| bad(e.to_string()))?;
        if meta.len() > TOKEN_FILE_MAX {
            return Err(bad(format!(
                "more than {TOKEN_FILE_MAX} bytes; a token is one line"
            )));
        }
        let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
        Token::parse(&text).ok_or_else(|| bad("no token in its first line".into()))
    }

    pub fn parse(text: &str) -> Option<Token> {
        let line = text.lines().next()?.trim();
        (!line.is_empty()).then(|| Token(line.as_bytes().to_vec()))
    }

    /// Whether an `Authorization` header's value is `Bearer` and this token. The comparison
    /// takes the same time wherever the first differing byte is.
    pub fn admits(&self, header: Option<&[u8]>) -> bool {
        let Some(h) = header else { return false };
        let Some(given) = h
            .strip_prefix(b"Bearer ")
            .or_else(|| h.strip_prefix(b"bearer "))
        else {
            return false;
        };
        bool::from(given.trim_ascii().ct_eq(&self.0))
    }
}

/// The token the address needs: none on loopback (unless given), required elsewhere.
pub fn token_for(addr: SocketAddr, file: Option<&Path>) -> Result<Option<Token>> {
    match file {
        Some(f) => Token::read(f).map(Some),
        None if addr.ip().is_loopback() => Ok(None),
        None => Err(Error::Usage(format!(
            "--serve {addr} is not a loopback address: give --serve-token-file FILE, whose \
             token every request must then carry (docs/serving.md)"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_port_alone_binds_loopback() {
        assert_eq!(parse_addr("9464").unwrap().to_string(), "127.0.0.1:9464");
        assert_eq!(parse_addr("[::1]:80").unwrap().to_string(), "[::1]:80");
        assert!(parse_addr("localhost:x").is_err());
        assert!(parse_addr("").is_err());
    }

    #[test]
    fn an_address_other_than_loopback_needs_a_token() {
        let any = parse_addr("0.0.0.0:9464").unwrap();
        let err = token_for(any, None).unwrap_err().to_string();
        assert!(err.contains("--serve-token-file"), "{err}");
        assert!(
            token_for(parse_addr("9464").unwrap(), None)
                .unwrap()
                .is_none()
        );
        let missing = token_for(any, Some(Path::new("/nonexistent/token")));
        assert!(missing.is_err());
    }

    #[test]
    fn only_the_bearer_token_is_admitted() {
        let t = Token::parse("s3cret\nignored\n").unwrap();
        assert!(t.admits(Some(b"Bearer s3cret")));
        assert!(!t.admits(Some(b"Bearer s3cre")));
        assert!(!t.admits(Some(b"Bearer s3cret2")));
        assert!(!t.admits(Some(b"Basic s3cret")));
        assert!(!t.admits(None));
        assert!(Token::parse("\n").is_none());
        assert!(Token::parse("").is_none());
    }
}
