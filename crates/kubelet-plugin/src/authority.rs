//! Makes the kubelet's gRPC `:authority` acceptable to our HTTP/2 server.
//!
//! The problem: the kubelet's plugin watcher dials the registration socket with grpc-go,
//! passing the raw socket path as the target and a custom unix dialer. grpc-go then sends the
//! percent-escaped path as the HTTP/2 `:authority`, e.g.
//! `%2Fvar%2Flib%2Fkubelet%2Fplugins_registry%2Fgpu.nvidia.com-reg.sock` (seen with
//! grpc-go 1.79 as the kubelet 1.36 uses it). `h2`, under tonic, parses `:authority` with
//! `http::uri::Authority`, which rejects `%` in a host name, and resets the stream with
//! PROTOCOL_ERROR: registration never completes.
//!
//! The fix: [`AuthorityFix`] sits between the socket and the HTTP/2 server and rewrites, in
//! the client-to-server direction only, every request header block whose `:authority` is not a
//! valid URI authority to carry `localhost` instead (a UDS has no host; nothing reads it). Why
//! this and not the alternatives:
//! - no released `h2` accepts such an authority, and a `[patch]` of `h2` or `http` would have
//!   to be carried forward by hand with every upgrade;
//! - serving registration with a hand-written HTTP/2 server would duplicate flow control and
//!   stream handling that `h2` already gets right;
//! - the adapter works on the wire format, which is fixed by RFC 7540/7541, so it keeps
//!   working across `h2`/tonic versions and for any client.
//!
//! How: HPACK is stateful (a block may insert into the client's dynamic table and later
//! blocks refer to it), so patching bytes in place is unsafe. The adapter decodes every
//! header block with its own HPACK decoder that mirrors the client's table, and re-encodes
//! every field as a literal *without indexing* and without Huffman coding. The server's
//! decoder therefore never gets a dynamic table entry and stays trivially in sync. Padding is
//! dropped, PRIORITY data and END_STREAM are kept, and blocks are re-split into HEADERS +
//! CONTINUATION frames of at most 16 KiB (the minimum SETTINGS_MAX_FRAME_SIZE, so always
//! allowed). All other frames and the server-to-client direction pass through untouched.
//! A header block that does not decode is a connection error in HTTP/2 anyway: the adapter
//! then fails the read and the connection closes.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// HTTP/2 client connection preface.
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const FRAME_HEADER_LEN: usize = 9;
const TYPE_HEADERS: u8 = 0x1;
const TYPE_CONTINUATION: u8 = 0x9;
const FLAG_END_STREAM: u8 = 0x1;
const FLAG_END_HEADERS: u8 = 0x4;
const FLAG_PADDED: u8 = 0x8;
const FLAG_PRIORITY: u8 = 0x20;
/// Largest frame payload we emit: the protocol minimum of SETTINGS_MAX_FRAME_SIZE.
const MAX_OUT_PAYLOAD: usize = 16_384;
/// Largest frame payload we accept from a client; the server advertises at most this much
/// unless configured otherwise (tonic keeps h2's default of 16 KiB), so more is a protocol
/// error that we refuse before buffering it.
const MAX_IN_PAYLOAD: usize = 1 << 24;
/// Largest header block (all fragments) we buffer.
const MAX_HEADER_BLOCK: usize = 1 << 20;
/// Authority put in place of one that is not a valid URI authority.
const REPLACEMENT_AUTHORITY: &[u8] = b"localhost";

/// An IO stream whose inbound HTTP/2 request headers get a valid `:authority`.
pub struct AuthorityFix<S> {
    inner: S,
    /// Raw bytes read from `inner`, not yet processed.
    input: Vec<u8>,
    /// Processed bytes ready for the reader.
    output: Vec<u8>,
    output_pos: usize,
    /// Bytes of the connection preface still to pass through.
    preface_left: usize,
    decoder: fluke_hpack::Decoder<'static>,
    /// A header block waiting for its CONTINUATION frames.
    pending: Option<PendingBlock>,
    eof: bool,
}

struct PendingBlock {
    stream_id: u32,
    flags: u8,
    priority: Option<[u8; 5]>,
    block: Vec<u8>,
}

fn protocol_error(message: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, message)
}

impl<S> AuthorityFix<S> {
    /// Wraps a freshly accepted server-side connection.
    pub fn new(inner: S) -> Self {
        AuthorityFix {
            inner,
            input: Vec::with_capacity(8192),
            output: Vec::with_capacity(8192),
            output_pos: 0,
            preface_left: PREFACE.len(),
            decoder: fluke_hpack::Decoder::new(),
            pending: None,
            eof: false,
        }
    }

    /// Moves every complete unit (preface bytes, frames) from `input` to `output`.
    fn process(&mut self) -> io::Result<()> {
        let mut pos = 0;
        if self.preface_left > 0 {
            let n = self.preface_left.min(self.input.len());
            self.output.extend_from_slice(&self.input[..n]);
            self.preface_left -= n;
            pos = n;
        }
        if self.preface_left == 0 {
            while self.input.len() - pos >= FRAME_HEADER_LEN {
                let h = &self.input[pos..pos + FRAME_HEADER_LEN];
                let len = (usize::from(h[0]) << 16) | (usize::from(h[1]) << 8) | usize::from(h[2]);
                if len > MAX_IN_PAYLOAD {
                    return Err(protocol_error(format!("frame of {len} bytes is too large")));
                }
                if self.input.len() - pos < FRAME_HEADER_LEN + len {
                    break;
                }
                let kind = h[3];
                let flags = h[4];
                let stream_id = u32::from_be_bytes([h[5], h[6], h[7], h[8]]) & 0x7fff_ffff;
                let start = pos + FRAME_HEADER_LEN;
                let end = start + len;
                match kind {
                    TYPE_HEADERS => {
                        let payload = self.input[start..end].to_vec();
                        self.on_headers(stream_id, flags, &payload)?;
                    }
                    TYPE_CONTINUATION => {
                        let payload = self.input[start..end].to_vec();
                        self.on_continuation(stream_id, flags, &payload)?;
                    }
                    _ => {
                        if self.pending.is_some() {
                            return Err(protocol_error(
                                "frame interleaved in a header block".to_owned(),
                            ));
                        }
                        self.output.extend_from_slice(&self.input[pos..end]);
                    }
                }
                pos = end;
            }
        }
        self.input.drain(..pos);
        Ok(())
    }

    fn on_headers(&mut self, stream_id: u32, flags: u8, payload: &[u8]) -> io::Result<()> {
        if self.pending.is_some() {
            return Err(protocol_error("HEADERS inside a header block".to_owned()));
        }
        let mut body = payload;
        let mut pad = 0usize;
        if flags & FLAG_PADDED != 0 {
            let (&p, rest) = body
                .split_first()
                .ok_or_else(|| protocol_error("padded HEADERS without pad length".to_owned()))?;
            pad = usize::from(p);
            body = rest;
        }
        let mut priority = None;
        if flags & FLAG_PRIORITY != 0 {
            if body.len() < 5 {
                return Err(protocol_error(
                    "HEADERS priority fields truncated".to_owned(),
                ));
            }
            let mut p = [0u8; 5];
            p.copy_from_slice(&body[..5]);
            priority = Some(p);
            body = &body[5..];
        }
        if pad > body.len() {
            return Err(protocol_error(
                "HEADERS padding longer than payload".to_owned(),
            ));
        }
        let fragment = &body[..body.len() - pad];
        self.pending = Some(PendingBlock {
            stream_id,
            flags,
            priority,
            block: fragment.to_vec(),
        });
        if flags & FLAG_END_HEADERS != 0 {
            self.finish_block()?;
        }
        Ok(())
    }

    fn on_continuation(&mut self, stream_id: u32, flags: u8, payload: &[u8]) -> io::Result<()> {
        let Some(pending) = self.pending.as_mut() else {
            return Err(protocol_error("CONTINUATION without HEADERS".to_owned()));
        };
        if pending.stream_id != stream_id {
            return Err(protocol_error("CONTINUATION for another stream".to_owned()));
        }
        pending.block.extend_from_slice(payload);
        if pending.block.len() > MAX_HEADER_BLOCK {
            return Err(protocol_error("header block too large".to_owned()));
        }
        if flags & FLAG_END_HEADERS != 0 {
            self.finish_block()?;
        }
        Ok(())
    }

    fn finish_block(&mut self) -> io::Result<()> {
        let Some(pending) = self.pending.take() else {
            return Ok(());
        };
        let mut fields = self
            .decoder
            .decode(&pending.block)
            .map_err(|e| protocol_error(format!("HPACK decoding failed: {e:?}")))?;
        for (name, value) in &mut fields {
            if name.as_slice() == b":authority" && !valid_authority(value) {
                *value = REPLACEMENT_AUTHORITY.to_vec();
            }
        }
        let block = encode_literals(&fields);
        write_header_frames(
            &mut self.output,
            pending.stream_id,
            pending.flags & FLAG_END_STREAM,
            pending.priority,
            &block,
        );
        Ok(())
    }
}

/// True when `h2` will accept the value as `:authority`.
fn valid_authority(value: &[u8]) -> bool {
    http::uri::Authority::try_from(value).is_ok()
}

/// HPACK-encodes fields as literals without indexing and without Huffman coding.
fn encode_literals(fields: &[(Vec<u8>, Vec<u8>)]) -> Vec<u8> {
    let mut out = Vec::with_capacity(fields.iter().map(|(n, v)| n.len() + v.len() + 4).sum());
    for (name, value) in fields {
        // 0000 0000: literal header field without indexing, new name.
        out.push(0);
        for s in [name, value] {
            out.extend_from_slice(&fluke_hpack::encoder::encode_integer(s.len(), 7));
            out.extend_from_slice(s);
        }
    }
    out
}

fn push_frame_header(out: &mut Vec<u8>, len: usize, kind: u8, flags: u8, stream_id: u32) {
    // `len` never exceeds MAX_OUT_PAYLOAD, so it fits the 24-bit length field.
    let len = len as u32;
    out.extend_from_slice(&len.to_be_bytes()[1..]);
    out.push(kind);
    out.push(flags);
    out.extend_from_slice(&stream_id.to_be_bytes());
}

/// Writes a header block as one HEADERS frame plus CONTINUATION frames as needed.
fn write_header_frames(
    out: &mut Vec<u8>,
    stream_id: u32,
    end_stream: u8,
    priority: Option<[u8; 5]>,
    block: &[u8],
) {
    let prio_len = if priority.is_some() { 5 } else { 0 };
    let first_len = block.len().min(MAX_OUT_PAYLOAD - prio_len);
    let (first, mut rest) = block.split_at(first_len);
    let mut flags = end_stream;
    if priority.is_some() {
        flags |= FLAG_PRIORITY;
    }
    if rest.is_empty() {
        flags |= FLAG_END_HEADERS;
    }
    push_frame_header(out, prio_len + first.len(), TYPE_HEADERS, flags, stream_id);
    if let Some(p) = priority {
        out.extend_from_slice(&p);
    }
    out.extend_from_slice(first);
    while !rest.is_empty() {
        let n = rest.len().min(MAX_OUT_PAYLOAD);
        let (chunk, tail) = rest.split_at(n);
        let flags = if tail.is_empty() { FLAG_END_HEADERS } else { 0 };
        push_frame_header(out, n, TYPE_CONTINUATION, flags, stream_id);
        out.extend_from_slice(chunk);
        rest = tail;
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for AuthorityFix<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if this.output_pos < this.output.len() {
                let n = buf.remaining().min(this.output.len() - this.output_pos);
                buf.put_slice(&this.output[this.output_pos..this.output_pos + n]);
                this.output_pos += n;
                if this.output_pos == this.output.len() {
                    this.output.clear();
                    this.output_pos = 0;
                }
                return Poll::Ready(Ok(()));
            }
            if this.eof {
                return Poll::Ready(Ok(()));
            }
            let mut chunk = [0u8; 8192];
            let mut chunk_buf = ReadBuf::new(&mut chunk);
            match Pin::new(&mut this.inner).poll_read(cx, &mut chunk_buf) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Ready(Ok(())) => {
                    let filled = chunk_buf.filled();
                    if filled.is_empty() {
                        // Peer closed: hand over whatever is left so the server sees the
                        // same truncated stream it would have seen without us.
                        this.eof = true;
                        let rest = std::mem::take(&mut this.input);
                        this.output.extend_from_slice(&rest);
                        continue;
                    }
                    this.input.extend_from_slice(filled);
                    this.process()?;
                }
            }
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for AuthorityFix<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

impl<S: tonic::transport::server::Connected> tonic::transport::server::Connected
    for AuthorityFix<S>
{
    type ConnectInfo = S::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The header block grpc-go 1.79.3 sent for `GetInfo` when dialing
    /// `/tmp/grpcprobe/gpu.nvidia.com-reg.sock` the way the kubelet's plugin watcher does
    /// (captured from a real client). `:authority` is
    /// `%2Ftmp%2Fgrpcprobe%2Fgpu.nvidia.com-reg.sock`, Huffman-coded and indexed.
    pub(crate) const GRPC_GO_GETINFO_BLOCK: &str = "8386459c62ba2d98d558598c84d83498f52fb4b31909b06931ea63115392a94f41a05458534d6a8b0cd6564aec3c65545866aed5eaee690c35c87a56b0b32e8393af5f8b1d75d0620d263d4c4d65647a8b9acac8b4c7602bbafaecff40027465864d833505b11f40899acac8b24d494f6a7f8613efbcf8416f";

    pub(crate) fn hex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
            .collect()
    }

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        push_frame_header(&mut out, payload.len(), kind, flags, stream);
        out.extend_from_slice(payload);
        out
    }

    fn run(input: &[u8]) -> Vec<u8> {
        let mut fix = AuthorityFix::new(());
        // Feed in small pieces to exercise partial frames.
        for piece in input.chunks(7) {
            fix.input.extend_from_slice(piece);
            fix.process().expect("processes");
        }
        assert!(fix.input.is_empty(), "all input consumed");
        fix.output
    }

    fn decode_frames(mut bytes: &[u8]) -> Vec<(u8, u8, u32, Vec<u8>)> {
        let mut frames = Vec::new();
        while !bytes.is_empty() {
            let len = (usize::from(bytes[0]) << 16)
                | (usize::from(bytes[1]) << 8)
                | usize::from(bytes[2]);
            let stream = u32::from_be_bytes([bytes[5], bytes[6], bytes[7], bytes[8]]);
            frames.push((bytes[3], bytes[4], stream, bytes[9..9 + len].to_vec()));
            bytes = &bytes[9 + len..];
        }
        frames
    }

    #[test]
    fn grpc_go_authority_is_replaced_and_dynamic_table_references_resolve() {
        let mut input = PREFACE.to_vec();
        input.extend(frame(0x4, 0, 0, &[])); // SETTINGS passes through
        input.extend(frame(
            TYPE_HEADERS,
            FLAG_END_HEADERS,
            1,
            &hex(GRPC_GO_GETINFO_BLOCK),
        ));
        // A second request as grpc-go encodes it: indexed references into the dynamic table
        // (66 = :authority, 65 = content-type, 63 = te), split over HEADERS + CONTINUATION
        // with padding.
        let path = b"/pluginregistration.Registration/GetInfo";
        let mut block = vec![0x83, 0x86, 0x04, path.len() as u8];
        block.extend_from_slice(path);
        block.extend_from_slice(&[0xc2, 0xc1, 0xbf]);
        let (a, b) = block.split_at(10);
        let mut padded = vec![3];
        padded.extend_from_slice(a);
        padded.extend_from_slice(&[0, 0, 0]);
        input.extend(frame(TYPE_HEADERS, FLAG_PADDED, 3, &padded));
        input.extend(frame(TYPE_CONTINUATION, FLAG_END_HEADERS, 3, b));
        let out = run(&input);

        assert_eq!(&out[..PREFACE.len()], PREFACE);
        let frames = decode_frames(&out[PREFACE.len()..]);
        assert_eq!(frames.len(), 3);
        assert_eq!(frames[0].0, 0x4);
        let mut server = fluke_hpack::Decoder::new();
        for (i, stream) in [(1, 1u32), (2, 3)] {
            let (kind, flags, id, payload) = &frames[i];
            assert_eq!((*kind, *id), (TYPE_HEADERS, stream));
            assert_eq!(flags & FLAG_END_HEADERS, FLAG_END_HEADERS);
            assert_eq!(flags & FLAG_PADDED, 0);
            let fields = server.decode(payload).expect("server decodes");
            let authority: Vec<&[u8]> = fields
                .iter()
                .filter(|(n, _)| n.as_slice() == b":authority")
                .map(|(_, v)| v.as_slice())
                .collect();
            assert_eq!(authority, [b"localhost".as_slice()]);
            assert!(
                fields
                    .iter()
                    .any(|(n, v)| n.as_slice() == b"te" && v.as_slice() == b"trailers")
            );
        }
    }

    #[test]
    fn valid_authority_is_kept_and_large_blocks_are_split() {
        let big = vec![b'x'; 40_000];
        let fields = vec![
            (b":authority".to_vec(), b"localhost:1234".to_vec()),
            (b"x-big".to_vec(), big.clone()),
        ];
        let mut client = fluke_hpack::Encoder::new();
        let block = client.encode(fields.iter().map(|(n, v)| (n.as_slice(), v.as_slice())));
        let mut input = PREFACE.to_vec();
        let (a, b) = block.split_at(block.len() / 2);
        input.extend(frame(
            TYPE_HEADERS,
            FLAG_END_STREAM | FLAG_PRIORITY,
            5,
            &[[0, 0, 0, 0, 15].as_slice(), a].concat(),
        ));
        input.extend(frame(TYPE_CONTINUATION, FLAG_END_HEADERS, 5, b));
        let out = run(&input);
        let frames = decode_frames(&out[PREFACE.len()..]);
        assert!(frames.len() >= 3, "40 KB block needs continuation frames");
        assert!(frames.iter().all(|f| f.3.len() <= MAX_OUT_PAYLOAD));
        assert_eq!(
            frames[0].1 & (FLAG_END_STREAM | FLAG_PRIORITY),
            FLAG_END_STREAM | FLAG_PRIORITY
        );
        let mut block = frames[0].3[5..].to_vec();
        for f in &frames[1..] {
            assert_eq!(f.0, TYPE_CONTINUATION);
            block.extend_from_slice(&f.3);
        }
        let decoded = fluke_hpack::Decoder::new().decode(&block).expect("decodes");
        assert_eq!(decoded, fields);
    }

    #[test]
    fn garbage_header_block_is_an_error_not_a_panic() {
        let mut input = PREFACE.to_vec();
        input.extend(frame(
            TYPE_HEADERS,
            FLAG_END_HEADERS,
            1,
            &[0xff, 0xff, 0xff, 0xff, 0xff, 0xff],
        ));
        let mut fix = AuthorityFix::new(());
        fix.input.extend_from_slice(&input);
        assert!(fix.process().is_err());
        let mut fix = AuthorityFix::new(());
        fix.input.extend_from_slice(PREFACE);
        fix.input
            .extend(frame(TYPE_CONTINUATION, FLAG_END_HEADERS, 1, &[]));
        assert!(fix.process().is_err());
    }
}
