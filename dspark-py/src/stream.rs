//! `dspark.TokenStream`: `Engine.generate_stream` on a background thread, its token events
//! sent over a channel and handed out by a Python iterator.
//!
//! The thread owns everything it uses (the engine behind its `Arc<Mutex<_>>`, the tokenizer,
//! the requests) and touches no Python object, so it never needs the GIL. When the iterator is
//! dropped or closed early, the thread's sends fail silently and it runs the call to its end,
//! which releases the engine's lock.

use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex, PoisonError};

use dspark::text::{StreamDecoder, Tokenizer};
use pyo3::prelude::*;

use crate::engine::{Requests, generation};
use crate::errors::{Failure, Kind, guarded, lock, new_err};
use crate::results::{Generation, StreamChunk, finish_fields};

/// What the generation thread sends.
enum Message {
    Chunk(StreamChunk),
    Done(Vec<Generation>),
    Failed(Failure),
}

/// An iterator of `StreamChunk`s, from `Engine.stream`. Also a context manager that closes it.
#[pyclass(module = "dspark", frozen)]
#[derive(Debug)]
pub struct TokenStream {
    /// `None` once the stream ended, failed or was closed.
    receiver: Mutex<Option<Receiver<Message>>>,
    results: Mutex<Option<Vec<Generation>>>,
}

impl TokenStream {
    /// Start generating `requests` on a new thread.
    pub(crate) fn start(
        engine: Arc<Mutex<dspark::Engine>>,
        tokenizer: Option<Tokenizer>,
        requests: Requests,
    ) -> std::io::Result<Self> {
        let (sender, receiver) = channel();
        std::thread::Builder::new()
            .name("dspark-stream".into())
            .spawn(move || produce(&engine, tokenizer.as_ref(), &requests, &sender))?;
        Ok(Self { receiver: Mutex::new(Some(receiver)), results: Mutex::new(None) })
    }
}

/// The body of the generation thread.
fn produce(
    engine: &Mutex<dspark::Engine>,
    tokenizer: Option<&Tokenizer>,
    requests: &Requests,
    sender: &Sender<Message>,
) {
    let outcome = guarded(|| {
        let mut decoders: Vec<Option<StreamDecoder>> =
            requests.iter().map(|_| tokenizer.map(|t| t.stream_decoder(true))).collect();
        let mut text_error = None;
        let out = lock(engine)?.generate_stream(requests, &mut |event| {
            let text = match decoders[event.request].as_mut() {
                Some(decoder) => {
                    let mut decode = || -> Result<String, dspark::text::TextError> {
                        let mut text = decoder.extend(event.tokens)?;
                        if event.finish.is_some() {
                            text.extend(decoder.flush()?);
                        }
                        Ok(text)
                    };
                    match decode() {
                        Ok(text) => Some(text),
                        Err(e) => {
                            text_error.get_or_insert(e);
                            None
                        }
                    }
                }
                None => None,
            };
            let (finish_reason, stop_token_id) = finish_fields(event.finish);
            // A closed stream no longer listens; the call still runs to its end.
            let _ = sender.send(Message::Chunk(StreamChunk {
                request: event.request,
                token_ids: event.tokens.to_vec(),
                text,
                finish_reason,
                stop_token_id,
            }));
        })?;
        if let Some(e) = text_error {
            return Err(e.into());
        }
        requests.iter().zip(out).map(|(r, g)| generation(tokenizer, r, g)).collect()
    });
    let _ = sender.send(match outcome {
        Ok(results) => Message::Done(results),
        Err(failure) => Message::Failed(failure),
    });
}

#[pymethods]
impl TokenStream {
    fn __iter__(slf: Bound<'_, Self>) -> Bound<'_, Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<Option<StreamChunk>> {
        // Wait without the GIL; the lock is taken without it too, so a second thread waiting
        // on the same stream cannot block the first one's return.
        let message = py.detach(|| {
            let mut receiver = self.receiver.lock().unwrap_or_else(PoisonError::into_inner);
            let message = receiver.as_ref()?.recv();
            if !matches!(message, Ok(Message::Chunk(_))) {
                *receiver = None;
            }
            Some(message)
        });
        match message {
            None => Ok(None),
            Some(Ok(Message::Chunk(chunk))) => Ok(Some(chunk)),
            Some(Ok(Message::Done(results))) => {
                *self.results.lock().unwrap_or_else(PoisonError::into_inner) = Some(results);
                Ok(None)
            }
            Some(Ok(Message::Failed(failure))) => Err(failure.into_py(py)),
            Some(Err(_)) => {
                Err(new_err(py, Kind::Internal, "the generation thread ended without a result", &[]))
            }
        }
    }

    /// The finished requests, in prompt order, once the iteration has ended; `None` before,
    /// and when the stream failed or was closed early.
    #[getter]
    fn results(&self) -> Option<Vec<Generation>> {
        self.results.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Stop listening: iteration ends. A generation still running finishes in the background.
    fn close(&self, py: Python<'_>) {
        py.detach(|| *self.receiver.lock().unwrap_or_else(PoisonError::into_inner) = None);
    }

    fn __enter__(slf: Bound<'_, Self>) -> Bound<'_, Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) -> bool {
        self.close(py);
        false
    }
}
