//! Text in, text out for Qwen3 checkpoints: tokenization, incremental detokenization and chat
//! templates.
//!
//! A Hugging Face checkpoint directory holds `tokenizer.json` (read with the `tokenizers`
//! crate), usually `tokenizer_config.json` (special tokens and the chat template), sometimes a
//! separate `chat_template.jinja` (newer layout) and `generation_config.json` (extra
//! end-of-sequence ids). [`Tokenizer::from_dir`] reads all of them.
//!
//! Chat templates are rendered with `minijinja`, set up the way `transformers` sets up jinja2
//! for `apply_chat_template`: `trim_blocks` and `lstrip_blocks` on, the trailing newline
//! dropped, loop controls, Python string methods (`startswith`, `split`, `strip`, ...), a
//! `raise_exception` function and a Python-compatible `tojson` filter.
//!
//! ```no_run
//! use std::path::Path;
//! use dspark::text::{ChatMessage, ChatOptions, Tokenizer};
//!
//! # fn main() -> Result<(), dspark::text::TextError> {
//! let tokenizer = Tokenizer::from_dir(Path::new("Qwen3-8B"))?;
//! let prompt = tokenizer.apply_chat_template(
//!     &[ChatMessage::user("Hi")],
//!     &ChatOptions { add_generation_prompt: true, enable_thinking: Some(false) },
//! )?;
//! let ids = tokenizer.encode(&prompt, false)?;
//! let mut stream = tokenizer.stream_decoder(true);
//! for &id in &ids {
//!     if let Some(text) = stream.step(id)? {
//!         print!("{text}");
//!     }
//! }
//! # Ok(())
//! # }
//! ```

use std::collections::BTreeMap;
use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use minijinja::value::Kwargs;
use minijinja::{Environment, ErrorKind, Value};
use serde::{Deserialize, Serialize};

/// File names looked up in a checkpoint directory.
const TOKENIZER_FILE: &str = "tokenizer.json";
const TOKENIZER_CONFIG_FILE: &str = "tokenizer_config.json";
const CHAT_TEMPLATE_JINJA_FILE: &str = "chat_template.jinja";
const CHAT_TEMPLATE_JSON_FILE: &str = "chat_template.json";
const GENERATION_CONFIG_FILE: &str = "generation_config.json";

/// Name under which the chat template is registered in its environment. It has no extension,
/// so minijinja turns no auto-escaping on.
const TEMPLATE_NAME: &str = "chat";

/// Errors of tokenization, detokenization and chat-template rendering.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TextError {
    /// A file could not be read.
    #[error("cannot read {}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: io::Error,
    },
    /// `tokenizer.json` was read but the `tokenizers` crate rejected it.
    #[error("cannot load tokenizer {}: {message}", path.display())]
    TokenizerLoad {
        /// The tokenizer file.
        path: PathBuf,
        /// What the `tokenizers` crate reported.
        message: String,
    },
    /// A JSON configuration file is malformed or has fields of unexpected types.
    #[error("invalid JSON in {}: {source}", path.display())]
    Json {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: serde_json::Error,
    },
    /// A chat template was asked for but the directory has none.
    #[error(
        "no chat template in {} (looked for chat_template.jinja, chat_template.json and the \
         `chat_template` key of tokenizer_config.json)",
        dir.display()
    )]
    NoChatTemplate {
        /// The directory that was searched.
        dir: PathBuf,
    },
    /// The chat template failed to compile or to render (including `raise_exception`).
    #[error("chat template error: {message}")]
    Template {
        /// The template engine's description, with its causes.
        message: String,
    },
    /// Encoding text into token ids failed.
    #[error("cannot encode text: {message}")]
    Encode {
        /// What the `tokenizers` crate reported.
        message: String,
    },
    /// Decoding token ids into text failed.
    #[error("cannot decode tokens: {message}")]
    Decode {
        /// What went wrong.
        message: String,
    },
    /// A token id has no entry in the vocabulary.
    #[error("token id {token} is not in the vocabulary (size {vocab})")]
    TokenOutOfRange {
        /// The offending id.
        token: u32,
        /// The vocabulary size, added tokens included.
        vocab: usize,
    },
}

/// One message of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    /// The message text.
    pub content: String,
}

impl ChatMessage {
    /// A message with the given role and content.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self { role: role.into(), content: content.into() }
    }

    /// A `system` message.
    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }

    /// A `user` message.
    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }

    /// An `assistant` message.
    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new("assistant", content)
    }
}

/// Options of [`ChatTemplate::render`], passed to the template as variables.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct ChatOptions {
    /// Append the header that opens the assistant's turn (`add_generation_prompt`).
    pub add_generation_prompt: bool,
    /// The `enable_thinking` variable of Qwen3 templates; left undefined when `None`, as when
    /// `apply_chat_template` is called without it.
    pub enable_thinking: Option<bool>,
}

/// A compiled chat template together with the special tokens it may refer to.
///
/// Cloning is cheap: the compiled template is shared.
#[derive(Clone)]
pub struct ChatTemplate {
    env: Arc<Environment<'static>>,
    source: Arc<str>,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source_len", &self.source.len())
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compiles a Jinja chat template. `bos_token` and `eos_token` become the template
    /// variables of the same names (undefined when `None`).
    ///
    /// # Errors
    ///
    /// [`TextError::Template`] when the template does not compile.
    pub fn new(
        source: impl Into<String>,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<Self, TextError> {
        let source: String = source.into();
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_filter("tojson", py_tojson);
        env.add_template_owned(TEMPLATE_NAME, source.clone()).map_err(template_error)?;
        Ok(Self { env: Arc::new(env), source: source.into(), bos_token, eos_token })
    }

    /// Loads the chat template of a checkpoint directory: `chat_template.jinja` if present,
    /// else `chat_template.json`, else the `chat_template` key of `tokenizer_config.json` (a
    /// string, or a list of `{"name", "template"}` of which the one named `default` is used).
    /// `bos_token` and `eos_token` come from `tokenizer_config.json`.
    ///
    /// # Errors
    ///
    /// [`TextError::NoChatTemplate`] when the directory has no template,
    /// [`TextError::Io`] or [`TextError::Json`] when a file exists but cannot be read or
    /// parsed, [`TextError::Template`] when the template does not compile or a template list
    /// has no `default` entry.
    pub fn from_dir(dir: &Path) -> Result<Self, TextError> {
        let config = DirConfig::read(dir)?;
        config.chat_template.ok_or_else(|| TextError::NoChatTemplate { dir: dir.to_path_buf() })
    }

    /// The template's source text.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The `bos_token` variable, if defined.
    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    /// The `eos_token` variable, if defined.
    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    /// Renders a conversation into a prompt, like `tokenizer.apply_chat_template(messages,
    /// tokenize=False, add_generation_prompt=..., enable_thinking=...)`.
    ///
    /// The template sees `messages`, `add_generation_prompt`, `enable_thinking` (only when
    /// set), `bos_token` and `eos_token` (only when known).
    ///
    /// # Errors
    ///
    /// [`TextError::Template`] when rendering fails, including when the template calls
    /// `raise_exception`.
    pub fn render(&self, messages: &[ChatMessage], opts: &ChatOptions) -> Result<String, TextError> {
        let template = self.env.get_template(TEMPLATE_NAME).map_err(template_error)?;
        let mut ctx: BTreeMap<&str, Value> = BTreeMap::new();
        ctx.insert("messages", Value::from_serialize(messages));
        ctx.insert("add_generation_prompt", Value::from(opts.add_generation_prompt));
        if let Some(thinking) = opts.enable_thinking {
            ctx.insert("enable_thinking", Value::from(thinking));
        }
        if let Some(bos) = &self.bos_token {
            ctx.insert("bos_token", Value::from(bos.as_str()));
        }
        if let Some(eos) = &self.eos_token {
            ctx.insert("eos_token", Value::from(eos.as_str()));
        }
        template.render(ctx).map_err(template_error)
    }
}

/// The `raise_exception(message)` function of Hugging Face chat templates.
fn raise_exception(message: String) -> Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
}

/// `tojson` as `transformers` defines it: `json.dumps(x, ensure_ascii=False, indent=indent)`,
/// so `", "` and `": "` separators, no HTML escaping. Map keys come out sorted.
fn py_tojson(value: &Value, kwargs: Kwargs) -> Result<Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    let mut out = Vec::new();
    let result = match indent {
        Some(width) => {
            let pad = vec![b' '; width];
            let mut ser = serde_json::Serializer::with_formatter(
                &mut out,
                serde_json::ser::PrettyFormatter::with_indent(&pad),
            );
            value.serialize(&mut ser)
        }
        None => {
            let mut ser = serde_json::Serializer::with_formatter(&mut out, PyCompactFormatter);
            value.serialize(&mut ser)
        }
    };
    result.map_err(|err| {
        minijinja::Error::new(ErrorKind::InvalidOperation, "cannot serialize to JSON").with_source(err)
    })?;
    let text = String::from_utf8(out).map_err(|err| {
        minijinja::Error::new(ErrorKind::InvalidOperation, "JSON output is not UTF-8").with_source(err)
    })?;
    Ok(Value::from_safe_string(text))
}

/// Python's default `json.dumps` layout: `[1, 2]`, `{"a": 1}`.
struct PyCompactFormatter;

impl serde_json::ser::Formatter for PyCompactFormatter {
    fn begin_array_value<W: ?Sized + io::Write>(&mut self, writer: &mut W, first: bool) -> io::Result<()> {
        if first { Ok(()) } else { writer.write_all(b", ") }
    }

    fn begin_object_key<W: ?Sized + io::Write>(&mut self, writer: &mut W, first: bool) -> io::Result<()> {
        if first { Ok(()) } else { writer.write_all(b", ") }
    }

    fn begin_object_value<W: ?Sized + io::Write>(&mut self, writer: &mut W) -> io::Result<()> {
        writer.write_all(b": ")
    }
}

/// A minijinja error with its chain of causes, as one line.
fn template_error(err: minijinja::Error) -> TextError {
    let mut message = err.to_string();
    let mut source = std::error::Error::source(&err);
    while let Some(cause) = source {
        message.push_str(": ");
        message.push_str(&cause.to_string());
        source = cause.source();
    }
    TextError::Template { message }
}

/// A special token in `tokenizer_config.json`: a string or an `AddedToken` object.
#[derive(Deserialize)]
#[serde(untagged)]
enum TokenField {
    Text(String),
    Object { content: String },
}

impl TokenField {
    fn into_content(self) -> String {
        match self {
            Self::Text(text) | Self::Object { content: text } => text,
        }
    }
}

/// `chat_template` in `tokenizer_config.json` or `chat_template.json`.
#[derive(Deserialize)]
#[serde(untagged)]
enum TemplateField {
    Text(String),
    Named(Vec<NamedTemplate>),
}

#[derive(Deserialize)]
struct NamedTemplate {
    name: String,
    template: String,
}

#[derive(Deserialize)]
struct TokenizerConfigFile {
    #[serde(default)]
    chat_template: Option<TemplateField>,
    #[serde(default)]
    bos_token: Option<TokenField>,
    #[serde(default)]
    eos_token: Option<TokenField>,
}

#[derive(Deserialize)]
struct ChatTemplateFile {
    #[serde(default)]
    chat_template: Option<TemplateField>,
}

/// `eos_token_id` in `generation_config.json`: one id or a list.
#[derive(Deserialize)]
#[serde(untagged)]
enum IdList {
    One(u32),
    Many(Vec<u32>),
}

#[derive(Deserialize)]
struct GenerationConfigFile {
    #[serde(default)]
    eos_token_id: Option<IdList>,
}

/// What a checkpoint directory says besides `tokenizer.json`.
struct DirConfig {
    bos_token: Option<String>,
    eos_token: Option<String>,
    chat_template: Option<ChatTemplate>,
}

impl DirConfig {
    fn read(dir: &Path) -> Result<Self, TextError> {
        let config: Option<TokenizerConfigFile> = read_json(&dir.join(TOKENIZER_CONFIG_FILE))?;
        let (config_template, bos_token, eos_token) = match config {
            Some(c) => (
                c.chat_template,
                c.bos_token.map(TokenField::into_content),
                c.eos_token.map(TokenField::into_content),
            ),
            None => (None, None, None),
        };

        let source = if let Some(text) = read_text(&dir.join(CHAT_TEMPLATE_JINJA_FILE))? {
            Some(text)
        } else {
            let file: Option<ChatTemplateFile> = read_json(&dir.join(CHAT_TEMPLATE_JSON_FILE))?;
            match file.and_then(|f| f.chat_template).or(config_template) {
                Some(field) => Some(pick_template(field)?),
                None => None,
            }
        };
        let chat_template =
            source.map(|s| ChatTemplate::new(s, bos_token.clone(), eos_token.clone())).transpose()?;
        Ok(Self { bos_token, eos_token, chat_template })
    }
}

/// The template to use out of a `chat_template` field.
fn pick_template(field: TemplateField) -> Result<String, TextError> {
    match field {
        TemplateField::Text(text) => Ok(text),
        TemplateField::Named(list) => {
            let names: Vec<String> = list.iter().map(|t| t.name.clone()).collect();
            list.into_iter().find(|t| t.name == "default").map(|t| t.template).ok_or_else(|| {
                TextError::Template {
                    message: format!(
                        "the chat template list has no template named \"default\" (it has {names:?})"
                    ),
                }
            })
        }
    }
}

/// Reads a text file; `Ok(None)` when it does not exist.
fn read_text(path: &Path) -> Result<Option<String>, TextError> {
    match std::fs::read_to_string(path) {
        Ok(text) => Ok(Some(text)),
        Err(err) if err.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(TextError::Io { path: path.to_path_buf(), source }),
    }
}

/// Reads and parses a JSON file; `Ok(None)` when it does not exist.
fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<Option<T>, TextError> {
    let Some(text) = read_text(path)? else {
        return Ok(None);
    };
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|source| TextError::Json { path: path.to_path_buf(), source })
}

/// A Hugging Face tokenizer with the chat template and end-of-sequence ids of its checkpoint.
///
/// Cloning is cheap: the tokenizer is shared.
#[derive(Clone)]
pub struct Tokenizer {
    inner: Arc<tokenizers::Tokenizer>,
    dir: PathBuf,
    chat_template: Option<ChatTemplate>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    eos_token_ids: Vec<u32>,
}

impl fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tokenizer")
            .field("dir", &self.dir)
            .field("vocab_size", &self.vocab_size())
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .field("eos_token_ids", &self.eos_token_ids)
            .field("chat_template", &self.chat_template.is_some())
            .finish_non_exhaustive()
    }
}

impl Tokenizer {
    /// Loads `tokenizer.json` from a checkpoint directory, with, when present,
    /// `tokenizer_config.json` (special tokens, chat template), `chat_template.jinja` or
    /// `chat_template.json` (chat template) and `generation_config.json` (`eos_token_id`, an
    /// id or a list of ids).
    ///
    /// # Errors
    ///
    /// [`TextError::Io`] when `tokenizer.json` is missing or a present file cannot be read,
    /// [`TextError::TokenizerLoad`] when `tokenizer.json` is not a valid tokenizer,
    /// [`TextError::Json`] when a configuration file is malformed, [`TextError::Template`]
    /// when the chat template does not compile.
    pub fn from_dir(dir: &Path) -> Result<Self, TextError> {
        let path = dir.join(TOKENIZER_FILE);
        let bytes = std::fs::read(&path).map_err(|source| TextError::Io { path: path.clone(), source })?;
        let inner = tokenizers::Tokenizer::from_bytes(&bytes)
            .map_err(|err| TextError::TokenizerLoad { path: path.clone(), message: err.to_string() })?;

        let config = DirConfig::read(dir)?;
        let generation: Option<GenerationConfigFile> = read_json(&dir.join(GENERATION_CONFIG_FILE))?;

        let mut eos_token_ids = Vec::new();
        if let Some(id) = config.eos_token.as_deref().and_then(|t| inner.token_to_id(t)) {
            eos_token_ids.push(id);
        }
        match generation.and_then(|g| g.eos_token_id) {
            Some(IdList::One(id)) => eos_token_ids.push(id),
            Some(IdList::Many(ids)) => eos_token_ids.extend(ids),
            None => {}
        }
        let mut seen = std::collections::HashSet::new();
        eos_token_ids.retain(|id| seen.insert(*id));

        Ok(Self {
            inner: Arc::new(inner),
            dir: dir.to_path_buf(),
            chat_template: config.chat_template,
            bos_token: config.bos_token,
            eos_token: config.eos_token,
            eos_token_ids,
        })
    }

    /// The directory the tokenizer was loaded from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The underlying `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// Encodes text into token ids. Special tokens written in the text (`<|im_start|>`, ...)
    /// become their ids. `add_special_tokens` asks the post-processor to add the model's
    /// special tokens (Qwen3's adds none).
    ///
    /// # Errors
    ///
    /// [`TextError::Encode`] when the `tokenizers` crate fails.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TextError> {
        let encoding = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|err| TextError::Encode { message: err.to_string() })?;
        Ok(encoding.get_ids().to_vec())
    }

    /// How often each id occurs in the encodings of `texts` (without added special tokens), in
    /// a vector of `vocab` counts (ids at or past `vocab` are not counted): the ranking
    /// [`crate::DraftVocab::most_frequent`] takes, from text like the traffic to serve.
    ///
    /// # Errors
    ///
    /// [`TextError::Encode`] when the `tokenizers` crate fails on a text.
    pub fn token_counts<'a>(
        &self,
        texts: impl IntoIterator<Item = &'a str>,
        vocab: usize,
    ) -> Result<Vec<u64>, TextError> {
        let mut counts = vec![0u64; vocab];
        for text in texts {
            for id in self.encode(text, false)? {
                if let Some(c) = counts.get_mut(id as usize) {
                    *c += 1;
                }
            }
        }
        Ok(counts)
    }

    /// [`Tokenizer::token_counts`] of a corpus on disk: the file `path`, or every file under the
    /// folder `path` (recursively, in path order). Files that are not UTF-8 text, and links to
    /// nothing, are not part of the corpus. Returns the counts and how many files were counted.
    ///
    /// # Errors
    ///
    /// [`TextError::Io`] when a file or folder cannot be read (or no file is text),
    /// [`TextError::Encode`] when the `tokenizers` crate fails on a file.
    pub fn corpus_counts(&self, path: &Path, vocab: usize) -> Result<(Vec<u64>, usize), TextError> {
        let io = |p: &Path, source: io::Error| TextError::Io { path: p.to_path_buf(), source };
        let mut counts = vec![0u64; vocab];
        let mut files = 0;
        let mut pending = vec![path.to_path_buf()];
        while let Some(p) = pending.pop() {
            if p.is_dir() {
                let mut entries = Vec::new();
                for entry in std::fs::read_dir(&p).map_err(|e| io(&p, e))? {
                    entries.push(entry.map_err(|e| io(&p, e))?.path());
                }
                entries.sort();
                pending.extend(entries.into_iter().rev());
                continue;
            }
            let text = match std::fs::read(&p).map(String::from_utf8) {
                Ok(Ok(text)) => text,
                Ok(Err(_)) => continue,
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => return Err(io(&p, e)),
            };
            let part = self.token_counts([text.as_str()], vocab)?;
            counts.iter_mut().zip(part).for_each(|(c, n)| *c += n);
            files += 1;
        }
        if files == 0 {
            let none = io::Error::new(io::ErrorKind::InvalidData, "no UTF-8 text file to count");
            return Err(io(path, none));
        }
        Ok((counts, files))
    }

    /// Decodes token ids into text, leaving out special tokens when `skip_special_tokens`.
    /// Bytes that do not form valid UTF-8 come out as U+FFFD.
    ///
    /// # Errors
    ///
    /// [`TextError::TokenOutOfRange`] when an id is not in the vocabulary,
    /// [`TextError::Decode`] when the `tokenizers` crate fails.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TextError> {
        for &id in ids {
            self.check_id(id)?;
        }
        self.decode_unchecked(ids, skip_special_tokens)
    }

    fn decode_unchecked(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TextError> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|err| TextError::Decode { message: err.to_string() })
    }

    fn check_id(&self, id: u32) -> Result<(), TextError> {
        if self.inner.id_to_token(id).is_some() {
            Ok(())
        } else {
            Err(TextError::TokenOutOfRange { token: id, vocab: self.vocab_size() })
        }
    }

    /// The vocabulary size, added tokens included (151 669 for Qwen3; the model's embedding
    /// table may be larger).
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The id of a token (special or not), if it is in the vocabulary.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The token of an id, if the id is in the vocabulary.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The `bos_token` of `tokenizer_config.json`, if set.
    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    /// The `eos_token` of `tokenizer_config.json`, if set.
    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    /// The ids that end generation: that of `tokenizer_config.json`'s `eos_token`, then those of
    /// `generation_config.json`'s `eos_token_id`, without repeats.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_token_ids
    }

    /// Whether `id` ends generation.
    pub fn is_eos(&self, id: u32) -> bool {
        self.eos_token_ids.contains(&id)
    }

    /// The checkpoint's chat template, if it has one.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat_template.as_ref()
    }

    /// Renders a conversation with the checkpoint's chat template (see
    /// [`ChatTemplate::render`]).
    ///
    /// # Errors
    ///
    /// [`TextError::NoChatTemplate`] when the checkpoint has no chat template,
    /// [`TextError::Template`] when rendering fails.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        opts: &ChatOptions,
    ) -> Result<String, TextError> {
        match &self.chat_template {
            Some(template) => template.render(messages, opts),
            None => Err(TextError::NoChatTemplate { dir: self.dir.clone() }),
        }
    }

    /// An incremental detokenizer over this tokenizer.
    pub fn stream_decoder(&self, skip_special_tokens: bool) -> StreamDecoder {
        StreamDecoder::new(self, skip_special_tokens)
    }
}

/// Incremental detokenizer: fed token ids one at a time, it returns the text they complete.
///
/// Text is emitted only once it decodes to whole characters: a character whose bytes are split
/// over several byte-level tokens is held back until its last byte arrives, so no U+FFFD is
/// emitted for a partly decoded character. The pieces returned by [`step`](Self::step),
/// [`extend`](Self::extend) and [`flush`](Self::flush) add up to
/// [`Tokenizer::decode`] of all the ids.
///
/// It decodes a short window of ids (those since the last emitted text plus the previous
/// emitted chunk, for context) and emits what the window adds to the previous chunk.
#[derive(Clone)]
pub struct StreamDecoder {
    tokenizer: Tokenizer,
    skip_special_tokens: bool,
    /// The previous emitted chunk followed by the ids not emitted yet.
    ids: Vec<u32>,
    /// How many of `ids` form the previous emitted chunk.
    prefix_len: usize,
    /// The decoding of `ids[..prefix_len]`.
    prefix_text: String,
}

impl fmt::Debug for StreamDecoder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StreamDecoder")
            .field("skip_special_tokens", &self.skip_special_tokens)
            .field("ids", &self.ids)
            .field("prefix_len", &self.prefix_len)
            .finish_non_exhaustive()
    }
}

impl StreamDecoder {
    /// A decoder that has seen no ids yet.
    pub fn new(tokenizer: &Tokenizer, skip_special_tokens: bool) -> Self {
        Self {
            tokenizer: tokenizer.clone(),
            skip_special_tokens,
            ids: Vec::new(),
            prefix_len: 0,
            prefix_text: String::new(),
        }
    }

    /// Feeds one id; returns the text it completes, or `None` when it completes none yet.
    ///
    /// # Errors
    ///
    /// [`TextError::TokenOutOfRange`] when the id is not in the vocabulary (the decoder is left
    /// as it was), [`TextError::Decode`] when decoding fails.
    pub fn step(&mut self, id: u32) -> Result<Option<String>, TextError> {
        self.tokenizer.check_id(id)?;
        self.ids.push(id);
        let text = self.decode_window()?;
        if text.ends_with(char::REPLACEMENT_CHARACTER) {
            return Ok(None);
        }
        self.emit(text)
    }

    /// Feeds several ids; returns the text they complete (possibly empty).
    ///
    /// # Errors
    ///
    /// As [`step`](Self::step); ids before the offending one have been consumed and their
    /// text is lost to the caller.
    pub fn extend(&mut self, ids: &[u32]) -> Result<String, TextError> {
        let mut out = String::new();
        for &id in ids {
            if let Some(text) = self.step(id)? {
                out.push_str(&text);
            }
        }
        Ok(out)
    }

    /// Returns the text held back, U+FFFD included for bytes that never formed a character
    /// (as [`Tokenizer::decode`] would give them), and starts afresh.
    ///
    /// # Errors
    ///
    /// [`TextError::Decode`] when decoding fails.
    pub fn flush(&mut self) -> Result<Option<String>, TextError> {
        let out = if self.ids.len() > self.prefix_len {
            let text = self.decode_window()?;
            self.emit(text)?
        } else {
            None
        };
        self.reset();
        Ok(out)
    }

    /// Forgets all ids fed so far.
    pub fn reset(&mut self) {
        self.ids.clear();
        self.prefix_len = 0;
        self.prefix_text.clear();
    }

    /// Whether ids are held back that have not produced text yet.
    pub fn has_pending(&self) -> bool {
        self.ids.len() > self.prefix_len
    }

    fn decode_window(&self) -> Result<String, TextError> {
        self.tokenizer.decode_unchecked(&self.ids, self.skip_special_tokens)
    }

    /// Emits what `text` (the decoding of the whole window) adds to the previous chunk and
    /// makes the pending ids the new previous chunk.
    fn emit(&mut self, text: String) -> Result<Option<String>, TextError> {
        let Some(new_text) = text.strip_prefix(self.prefix_text.as_str()) else {
            return Err(TextError::Decode {
                message: format!(
                    "incremental decoding diverged: {:?} does not start with {:?}",
                    text, self.prefix_text
                ),
            });
        };
        if new_text.is_empty() {
            // Nothing visible yet (e.g. a skipped special token): keep waiting, with the
            // same prefix.
            return Ok(None);
        }
        let new_text = new_text.to_owned();
        self.ids.drain(..self.prefix_len);
        self.prefix_len = self.ids.len();
        self.prefix_text = self.decode_window()?;
        Ok(Some(new_text))
    }
}
