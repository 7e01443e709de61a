//! The small files the config names: password files, CA bundles, client
//! certificates and their keys. They are read at load and again at every
//! connect (a rotated password, a renewed certificate, a new CA take
//! effect without a restart), on the runtime's one thread, so a path that
//! names the wrong kind of file must fail rather than wait or fill the
//! memory:
//!
//! - a pipe (`mkfifo`, or a shell's `<(...)`: read once at load, then
//!   every later open waits for a writer that never comes), a device
//!   (`/dev/zero` never ends, a terminal waits for a line, and opening
//!   some devices does something) and a directory are refused: by the
//!   path's type before it is opened, and by the opened file's (opened
//!   without blocking, so a pipe swapped in between is refused as one
//!   rather than waited on);
//! - a file larger than its kind ever is (a log or a disk image named by
//!   mistake) is refused without reading it all.
//!
//! systemd credentials (`LoadCredential=`, on ramfs), Kubernetes secret
//! volumes (tmpfs, symlinks to regular files) and certificates renewed in
//! place are regular files, and pass. What this cannot help is a regular
//! file on a network filesystem that stopped answering (a hard-mounted
//! NFS): reading it waits as any read would (pgwire-replication reads the
//! client certificate's files itself, too); keep these files local.

use std::io::Read;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;

/// The most a password file may hold.
pub const PASSWORD_LIMIT: u64 = 64 * 1024;

/// The most a PEM file (a CA bundle, a certificate chain, a key) may hold:
/// the distributions' whole CA bundles are about 200 KB.
pub const PEM_LIMIT: u64 = 4 * 1024 * 1024;

/// What `path` holds, if it is a regular file of at most `limit` bytes.
/// The message names the file and what is wrong with it (the caller
/// names the setting).
pub fn read(path: &Path, limit: u64) -> Result<Vec<u8>, String> {
    let shown = path.display();
    let not_a_file = |kind| {
        format!(
            "{shown} is {}, not a regular file: it is read again at every connect, \
             so it must be a file that holds its content (not a pipe or a device)",
            kind_name(kind)
        )
    };
    // Before opening: opening a device may do something.
    let kind = std::fs::metadata(path)
        .map_err(|e| format!("cannot read {shown}: {e}"))?
        .file_type();
    if !kind.is_file() {
        return Err(not_a_file(kind));
    }
    let file = std::fs::OpenOptions::new()
        .read(true)
        // Not blocking on a pipe without a writer (refused below), and not
        // taking a terminal as the controlling one.
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(|e| format!("cannot read {shown}: {e}"))?;
    let kind = file
        .metadata()
        .map_err(|e| format!("cannot read {shown}: {e}"))?
        .file_type();
    if !kind.is_file() {
        return Err(not_a_file(kind));
    }
    let mut content = Vec::new();
    (&file)
        .take(limit + 1)
        .read_to_end(&mut content)
        .map_err(|e| format!("cannot read {shown}: {e}"))?;
    if content.len() as u64 > limit {
        return Err(format!(
            "{shown} is larger than {} KiB: not the file meant here",
            limit / 1024
        ));
    }
    Ok(content)
}

/// As [`read`], for a file of text.
pub fn read_text(path: &Path, limit: u64) -> Result<String, String> {
    String::from_utf8(read(path, limit)?)
        .map_err(|_| format!("{} is not UTF-8 text", path.display()))
}

fn kind_name(kind: std::fs::FileType) -> &'static str {
    if kind.is_dir() {
        "a directory"
    } else if kind.is_fifo() {
        "a pipe"
    } else if kind.is_char_device() {
        "a character device"
    } else if kind.is_block_device() {
        "a block device"
    } else if kind.is_socket() {
        "a socket"
    } else {
        "not a regular file"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::time::Duration;

    /// `read` on another thread, failing the test (not hanging it) when it
    /// does not return.
    fn read_soon(path: &Path, limit: u64) -> Result<Vec<u8>, String> {
        let (tx, rx) = mpsc::channel();
        let path = path.to_owned();
        std::thread::spawn(move || tx.send(read(&path, limit)));
        rx.recv_timeout(Duration::from_secs(10))
            .expect("read returns without waiting")
    }

    #[test]
    fn a_regular_file_is_read_whole() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("pw");
        std::fs::write(&f, "secret\n").unwrap();
        assert_eq!(read_soon(&f, 7).unwrap(), b"secret\n");
        assert_eq!(read_text(&f, 64).unwrap(), "secret\n");
    }

    #[test]
    fn a_pipe_without_a_writer_is_refused_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        let status = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap();
        assert!(status.success());
        let err = read_soon(&fifo, PASSWORD_LIMIT).unwrap_err();
        assert!(err.contains("is a pipe, not a regular file"), "{err}");
    }

    #[test]
    fn devices_and_directories_are_refused() {
        let err = read_soon(Path::new("/dev/zero"), PEM_LIMIT).unwrap_err();
        assert!(err.contains("/dev/zero is a character device"), "{err}");
        let dir = tempfile::tempdir().unwrap();
        let err = read_soon(dir.path(), PEM_LIMIT).unwrap_err();
        assert!(err.contains("is a directory"), "{err}");
    }

    #[test]
    fn a_file_over_the_limit_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("big");
        std::fs::write(&f, vec![b'x'; 2049]).unwrap();
        let err = read_soon(&f, 2048).unwrap_err();
        assert!(err.contains("is larger than 2 KiB"), "{err}");
        assert_eq!(read_soon(&f, 2049).unwrap().len(), 2049);
    }

    #[test]
    fn a_missing_file_and_bad_text_say_so() {
        let err = read_soon(Path::new("/no/such/file"), 64).unwrap_err();
        assert!(err.contains("cannot read /no/such/file"), "{err}");
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("bin");
        std::fs::write(&f, [0xff, 0xfe]).unwrap();
        assert!(read_text(&f, 64).unwrap_err().contains("not UTF-8"));
    }
}
