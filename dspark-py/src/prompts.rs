//! Reading the `prompts` and `params` arguments: text, chat messages or token ids, one or many.

use dspark::text::ChatMessage;
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyMapping, PyString};

use crate::errors::{Kind, new_err};
use crate::params::SamplingParams;

/// One prompt as given.
#[derive(Debug, Clone)]
pub(crate) enum Prompt {
    /// Text, tokenized with the engine's tokenizer.
    Text(String),
    /// A conversation, rendered with the chat template and tokenized.
    Chat(Vec<ChatMessage>),
    /// Token ids, used as they are.
    Ids(Vec<u32>),
}

const PROMPT_TYPES: &str = "a prompt is a str, a list of token ids (int) or a list of chat messages \
                            ({\"role\": str, \"content\": str})";

/// `prompts` of `generate`/`stream`: one prompt, or a list of prompts. Returns the prompts and
/// whether a single prompt was given. An empty list is a batch of no prompts.
pub(crate) fn parse_prompts(obj: &Bound<'_, PyAny>, vocab: usize) -> PyResult<(Vec<Prompt>, bool)> {
    if obj.is_instance_of::<PyString>() {
        return Ok((vec![parse_prompt(obj, vocab)?], true));
    }
    let items = items_of(obj)?;
    match items.first() {
        None => Ok((Vec::new(), false)),
        Some(first) if is_token(first) || first.cast::<PyMapping>().is_ok() => {
            Ok((vec![parse_items(&items, vocab)?], true))
        }
        Some(_) => Ok((items.iter().map(|p| parse_prompt(p, vocab)).collect::<PyResult<_>>()?, false)),
    }
}

/// One prompt: text, token ids or chat messages.
pub(crate) fn parse_prompt(obj: &Bound<'_, PyAny>, vocab: usize) -> PyResult<Prompt> {
    if let Ok(text) = obj.cast::<PyString>() {
        return Ok(Prompt::Text(text.to_cow()?.into_owned()));
    }
    parse_items(&items_of(obj)?, vocab)
}

fn items_of<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Vec<Bound<'py, PyAny>>> {
    let iter = obj
        .try_iter()
        .map_err(|_| PyTypeError::new_err(format!("{PROMPT_TYPES}; got {}", type_name(obj))))?;
    iter.collect()
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into())
}

fn is_token(obj: &Bound<'_, PyAny>) -> bool {
    !obj.is_instance_of::<PyString>() && obj.extract::<i64>().is_ok()
}

/// The items of one non-text prompt: all token ids, or all chat messages.
fn parse_items(items: &[Bound<'_, PyAny>], vocab: usize) -> PyResult<Prompt> {
    match items.first() {
        None => Ok(Prompt::Ids(Vec::new())),
        Some(first) if first.cast::<PyMapping>().is_ok() => {
            Ok(Prompt::Chat(items.iter().enumerate().map(|(i, m)| message(i, m)).collect::<PyResult<_>>()?))
        }
        Some(_) => Ok(Prompt::Ids(items.iter().map(|t| token_id(t, vocab)).collect::<PyResult<_>>()?)),
    }
}

/// One token id: an int in `0..2^32` (the engine checks it against the vocabulary).
pub(crate) fn token_id(obj: &Bound<'_, PyAny>, vocab: usize) -> PyResult<u32> {
    if !is_token(obj) {
        return Err(PyTypeError::new_err(format!(
            "token ids are ints, got {}; {PROMPT_TYPES}",
            type_name(obj)
        )));
    }
    let value: i64 = obj.extract()?;
    u32::try_from(value).map_err(|_| {
        let py = obj.py();
        new_err(
            py,
            Kind::TokenOutOfRange,
            format!("token id {value} is out of range (vocabulary size {vocab})"),
            &[
                (
                    "token",
                    value.into_pyobject(py).map(|v| v.into_any().unbind()).unwrap_or_else(|_| py.None()),
                ),
                (
                    "vocab",
                    vocab.into_pyobject(py).map(|v| v.into_any().unbind()).unwrap_or_else(|_| py.None()),
                ),
            ],
        )
    })
}

/// Token ids given directly (`score`, `decode`).
pub(crate) fn token_ids(obj: &Bound<'_, PyAny>, vocab: usize) -> PyResult<Vec<u32>> {
    items_of(obj)?.iter().map(|t| token_id(t, vocab)).collect()
}

/// One chat message: a mapping with str `role` and `content`.
fn message(index: usize, obj: &Bound<'_, PyAny>) -> PyResult<ChatMessage> {
    let py = obj.py();
    let mapping = obj.cast::<PyMapping>().map_err(|_| {
        new_err(py, Kind::InvalidInput, format!("chat message {index} is not a mapping"), &[])
    })?;
    let field = |key: &str| -> PyResult<String> {
        let value = mapping.get_item(key).map_err(|_| {
            new_err(py, Kind::InvalidInput, format!("chat message {index} has no {key:?}"), &[])
        })?;
        value.extract::<String>().map_err(|_| {
            new_err(py, Kind::InvalidInput, format!("chat message {index}: {key:?} is not a str"), &[])
        })
    };
    Ok(ChatMessage::new(field("role")?, field("content")?))
}

/// Chat messages given directly (`apply_chat_template`).
pub(crate) fn messages(obj: &Bound<'_, PyAny>) -> PyResult<Vec<ChatMessage>> {
    items_of(obj)?.iter().enumerate().map(|(i, m)| message(i, m)).collect()
}

/// `params`: `None` (defaults), one `SamplingParams` for every request, or one per request.
pub(crate) fn parse_params(obj: Option<&Bound<'_, PyAny>>, count: usize) -> PyResult<Vec<SamplingParams>> {
    let Some(obj) = obj else {
        return Ok(vec![SamplingParams::default(); count]);
    };
    if let Ok(p) = obj.cast::<SamplingParams>() {
        return Ok(vec![p.borrow().clone(); count]);
    }
    let list: Vec<SamplingParams> = items_of(obj)
        .and_then(|items| items.iter().map(|p| Ok(p.cast::<SamplingParams>()?.borrow().clone())).collect())
        .map_err(|_| {
            PyTypeError::new_err("params is a SamplingParams, a list of them (one per prompt) or None")
        })?;
    if list.len() != count {
        return Err(new_err(
            obj.py(),
            Kind::InvalidInput,
            format!("{} SamplingParams for {count} prompts", list.len()),
            &[],
        ));
    }
    Ok(list)
}
