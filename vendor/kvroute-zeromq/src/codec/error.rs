use thiserror::Error;

/// Represents an error when encoding/decoding raw byte buffers and frames
#[non_exhaustive]
#[derive(Error, Debug)]
pub enum CodecError {
    #[error("{0}")]
    Command(&'static str),
    #[error("{0}")]
    Greeting(&'static str),
    #[error("{0}")]
    Mechanism(&'static str),
    #[error("{0}")]
    Decode(&'static str),
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Other(&'static str),
    /// kvroute patch: a frame header declared more than
    /// [`SocketOptions::max_frame_size`](crate::SocketOptions::max_frame_size).
    #[error("frame of {declared} bytes exceeds the limit of {limit} bytes")]
    FrameTooLarge {
        /// Length the peer declared.
        declared: u64,
        /// The configured limit.
        limit: usize,
    },
    /// kvroute patch: a multipart message would grow past
    /// [`SocketOptions::max_message_size`](crate::SocketOptions::max_message_size).
    #[error("multipart message of at least {size} bytes exceeds the limit of {limit} bytes")]
    MessageTooLarge {
        /// Bytes already buffered plus the length the next frame declared.
        size: u64,
        /// The configured limit.
        limit: usize,
    },
    /// kvroute patch: a multipart message would have more parts than
    /// [`SocketOptions::max_message_parts`](crate::SocketOptions::max_message_parts).
    #[error("multipart message exceeds the limit of {limit} parts")]
    TooManyParts {
        /// The configured limit.
        limit: usize,
    },
}

impl CodecError {
    /// kvroute patch: `true` when the peer was refused for exceeding a receive
    /// limit (frame size, message size or part count).
    #[must_use]
    pub fn is_limit_exceeded(&self) -> bool {
        matches!(
            self,
            Self::FrameTooLarge { .. } | Self::MessageTooLarge { .. } | Self::TooManyParts { .. }
        )
    }
}

pub(crate) type CodecResult<T> = Result<T, CodecError>;
