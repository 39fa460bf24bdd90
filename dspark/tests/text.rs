//! Tokenizer, incremental detokenizer and chat-template tests on the small fixture tokenizer
//! in `tests/fixtures/text/` (see `scripts/make_text_fixture.py`).

use std::path::{Path, PathBuf};

use dspark::text::{ChatMessage, ChatOptions, ChatTemplate, TextError, Tokenizer};
use serde::Deserialize;

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/text")
}

fn tokenizer() -> Tokenizer {
    match Tokenizer::from_dir(&fixture_dir()) {
        Ok(tok) => tok,
        Err(err) => panic!("cannot load the fixture tokenizer: {err}"),
    }
}

/// A fresh, empty directory for one test, removed when dropped.
struct ScratchDir(PathBuf);

impl ScratchDir {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("dspark-text-test-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create scratch dir");
        Self(dir)
    }

    fn path(&self) -> &Path {
        &self.0
    }

    fn write(&self, file: &str, contents: &str) {
        std::fs::write(self.0.join(file), contents).expect("write scratch file");
    }

    fn copy_fixture(&self, file: &str) {
        std::fs::copy(fixture_dir().join(file), self.0.join(file)).expect("copy fixture");
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

const SAMPLES: &[&str] = &[
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "",
    " leading and trailing spaces  ",
    "h\u{e9}llo \u{4e16}\u{754c} \u{1f389}",
    "Caf\u{e9} na\u{ef}ve \u{41f}\u{440}\u{438}\u{432}\u{435}\u{442} \u{65e5}\u{672c}\u{8a9e} \u{2728}\u{1f680}",
    "def f(x):\n    return x * 2\n\n\nclass A:\n\tpass\r\n",
    "numbers 1234567890 and symbols !@#$%^&*()_+-=[]{}|;':\",./<>?`~",
    "I'm sure they'll say it's fine, we've done it, you're right.",
];

#[test]
fn round_trip() {
    let tok = tokenizer();
    for &text in SAMPLES {
        let ids = tok.encode(text, false).expect("encode");
        let back = tok.decode(&ids, false).expect("decode");
        assert_eq!(back, text, "ids {ids:?}");
        let with_special = tok.encode(text, true).expect("encode");
        assert_eq!(with_special, ids, "Qwen-style post-processing adds no tokens");
    }
}

#[test]
fn multi_byte_characters_span_several_tokens() {
    // The point of the stream-decoder tests below: with this small vocabulary, CJK and emoji
    // characters are split over byte-level tokens.
    let tok = tokenizer();
    let ids = tok.encode("\u{1f389}", false).expect("encode");
    assert!(ids.len() > 1, "{ids:?}");
    let partial = tok.decode(&ids[..1], false).expect("decode");
    assert_eq!(partial, "\u{fffd}");
}

#[test]
fn special_tokens() {
    let tok = tokenizer();
    assert_eq!(tok.vocab_size(), 645);
    let endoftext = tok.token_to_id("<|endoftext|>").expect("<|endoftext|>");
    let im_start = tok.token_to_id("<|im_start|>").expect("<|im_start|>");
    let im_end = tok.token_to_id("<|im_end|>").expect("<|im_end|>");
    let think = tok.token_to_id("<think>").expect("<think>");
    let end_think = tok.token_to_id("</think>").expect("</think>");
    assert_eq!(tok.id_to_token(im_end).as_deref(), Some("<|im_end|>"));
    assert_eq!(tok.token_to_id("<|not_a_token|>"), None);

    let text = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nHello<|im_end|><|endoftext|>";
    let ids = tok.encode(text, false).expect("encode");
    for (id, count) in [(im_start, 2), (im_end, 2), (think, 1), (end_think, 1), (endoftext, 1)] {
        assert_eq!(ids.iter().filter(|&&i| i == id).count(), count, "id {id}");
    }
    assert_eq!(ids.first(), Some(&im_start));
    assert_eq!(tok.decode(&ids, false).expect("decode"), text);
    // <think> and </think> are added tokens but, as in Qwen3, not special ones.
    assert_eq!(tok.decode(&ids, true).expect("decode"), "user\nHi\nassistant\n<think>\n\n</think>\n\nHello");

    assert_eq!(tok.eos_token(), Some("<|im_end|>"));
    assert_eq!(tok.bos_token(), None);
    assert_eq!(tok.eos_token_ids(), &[im_end, endoftext]);
    assert!(tok.is_eos(im_end) && tok.is_eos(endoftext) && !tok.is_eos(im_start));
}

#[test]
fn decode_out_of_range_is_typed() {
    let tok = tokenizer();
    let vocab = tok.vocab_size();
    let bad = u32::try_from(vocab).expect("vocab fits u32");
    match tok.decode(&[1, 2, bad], false) {
        Err(TextError::TokenOutOfRange { token, vocab: v }) => {
            assert_eq!(token, bad);
            assert_eq!(v, vocab);
        }
        other => panic!("expected TokenOutOfRange, got {other:?}"),
    }
    assert!(matches!(tok.decode(&[u32::MAX], true), Err(TextError::TokenOutOfRange { token: u32::MAX, .. })));

    let mut stream = tok.stream_decoder(false);
    let hi = tok.encode("hi", false).expect("encode");
    let first = stream.extend(&hi).expect("extend");
    assert!(matches!(stream.step(bad), Err(TextError::TokenOutOfRange { .. })));
    // The failed step left the decoder usable.
    let rest = stream.extend(&tok.encode(" there", false).expect("encode")).expect("extend");
    assert_eq!(first + &rest, "hi there");
}

/// Feeds `ids` one by one and checks the pieces.
fn stream_pieces(tok: &Tokenizer, ids: &[u32], skip_special_tokens: bool) -> Vec<String> {
    let mut stream = tok.stream_decoder(skip_special_tokens);
    let mut pieces = Vec::new();
    for &id in ids {
        if let Some(piece) = stream.step(id).expect("step") {
            assert!(!piece.is_empty());
            pieces.push(piece);
        }
    }
    if let Some(piece) = stream.flush().expect("flush") {
        pieces.push(piece);
    }
    assert!(!stream.has_pending());
    pieces
}

#[test]
fn stream_decoder_matches_full_decode() {
    let tok = tokenizer();
    let mut all = SAMPLES.to_vec();
    all.push("<|im_start|>assistant\n<think>\n\u{1f914}\n</think>\n\nh\u{e9}llo \u{4e16}\u{754c} \u{1f389}<|im_end|>");
    for text in all {
        let ids = tok.encode(text, false).expect("encode");
        for skip in [false, true] {
            let pieces = stream_pieces(&tok, &ids, skip);
            let full = tok.decode(&ids, skip).expect("decode");
            assert_eq!(pieces.concat(), full, "skip_special_tokens={skip}");
            for piece in &pieces {
                assert!(!piece.contains('\u{fffd}'), "{piece:?} in {pieces:?}");
            }
        }
    }
}

#[test]
fn stream_decoder_holds_back_partial_characters() {
    let tok = tokenizer();
    let text = "h\u{e9}llo \u{4e16}\u{754c} \u{1f389}";
    let ids = tok.encode(text, false).expect("encode");
    let mut stream = tok.stream_decoder(false);
    let mut out = String::new();
    let mut held_back = 0;
    for &id in &ids {
        match stream.step(id).expect("step") {
            Some(piece) => {
                assert!(!piece.contains('\u{fffd}'));
                out.push_str(&piece);
            }
            None => {
                held_back += 1;
                assert!(stream.has_pending());
            }
        }
        // Whatever was emitted so far is a prefix of the text.
        assert!(text.starts_with(&out), "{out:?}");
    }
    assert_eq!(out, text);
    assert!(held_back > 0, "expected some ids to complete no character");
    assert_eq!(stream.flush().expect("flush"), None);
}

#[test]
fn stream_decoder_flush_gives_dangling_bytes() {
    let tok = tokenizer();
    let ids = tok.encode("ok \u{1f389}", false).expect("encode");
    let cut = &ids[..ids.len() - 1];
    let mut stream = tok.stream_decoder(false);
    let emitted = stream.extend(cut).expect("extend");
    assert!(!emitted.contains('\u{fffd}'));
    let rest = stream.flush().expect("flush").unwrap_or_default();
    assert_eq!(emitted + &rest, tok.decode(cut, false).expect("decode"));
    assert!(rest.ends_with('\u{fffd}'));
    // After a flush the decoder starts afresh.
    assert_eq!(stream.extend(&ids).expect("extend"), "ok \u{1f389}");
}

#[derive(Deserialize)]
struct ChatCases {
    cases: Vec<ChatCase>,
}

#[derive(Deserialize)]
struct ChatCase {
    name: String,
    messages: Vec<ChatMessage>,
    add_generation_prompt: bool,
    enable_thinking: Option<bool>,
    expected: String,
}

fn chat_cases() -> Vec<ChatCase> {
    let path = fixture_dir().join("chat_cases.json");
    let text = std::fs::read_to_string(&path).expect("read chat_cases.json");
    let cases: ChatCases = serde_json::from_str(&text).expect("parse chat_cases.json");
    assert!(cases.cases.len() >= 10);
    cases.cases
}

fn check_cases(template: &ChatTemplate, label: &str) {
    for case in chat_cases() {
        let opts = ChatOptions {
            add_generation_prompt: case.add_generation_prompt,
            enable_thinking: case.enable_thinking,
        };
        let got = match template.render(&case.messages, &opts) {
            Ok(got) => got,
            Err(err) => panic!("{label}: case {}: {err}", case.name),
        };
        assert_eq!(got, case.expected, "{label}: case {}", case.name);
    }
}

#[test]
fn qwen3_chat_template_matches_transformers() {
    let tok = tokenizer();
    let template = tok.chat_template().expect("fixture has a chat template");
    assert_eq!(template.eos_token(), Some("<|im_end|>"));
    assert_eq!(template.bos_token(), None);
    check_cases(template, "tokenizer_config.json");
}

#[test]
fn qwen3_no_thinking_prompt() {
    let tok = tokenizer();
    let prompt = tok
        .apply_chat_template(
            &[ChatMessage::system("You are helpful."), ChatMessage::user("Hi")],
            &ChatOptions { add_generation_prompt: true, enable_thinking: Some(false) },
        )
        .expect("render");
    assert_eq!(
        prompt,
        "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    );
    // The rendered prompt tokenizes with its markers as single special tokens.
    let ids = tok.encode(&prompt, false).expect("encode");
    let im_start = tok.token_to_id("<|im_start|>").expect("<|im_start|>");
    assert_eq!(ids.iter().filter(|&&i| i == im_start).count(), 3);
    assert_eq!(tok.decode(&ids, false).expect("decode"), prompt);
}

#[test]
fn chat_template_jinja_file_takes_precedence() {
    // jinja_layout/ holds the initial-release Qwen3 template as chat_template.jinja, the newer
    // layout; it renders the same cases identically.
    let template = ChatTemplate::from_dir(&fixture_dir().join("jinja_layout")).expect("load template");
    assert!(template.source().contains("enable_thinking is defined and enable_thinking is false"));
    check_cases(&template, "chat_template.jinja");

    // chat_template.jinja wins over tokenizer_config.json's chat_template.
    let dir = ScratchDir::new("precedence");
    dir.copy_fixture("tokenizer.json");
    dir.copy_fixture("tokenizer_config.json");
    dir.write("chat_template.jinja", "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}");
    let tok = Tokenizer::from_dir(dir.path()).expect("load");
    let out = tok.apply_chat_template(&[ChatMessage::user("x")], &ChatOptions::default()).expect("render");
    assert_eq!(out, "[user]x");
}

#[test]
fn eos_token_object_form_and_single_generation_eos() {
    let dir = ScratchDir::new("eos-object");
    dir.copy_fixture("tokenizer.json");
    dir.write(
        "tokenizer_config.json",
        r#"{
            "bos_token": {"__type": "AddedToken", "content": "<|endoftext|>", "lstrip": false},
            "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "special": true},
            "chat_template": [
                {"name": "tool_use", "template": "TOOLS"},
                {"name": "default", "template": "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}"}
            ]
        }"#,
    );
    dir.write("generation_config.json", r#"{"eos_token_id": 640}"#);
    let tok = Tokenizer::from_dir(dir.path()).expect("load");
    let im_end = tok.token_to_id("<|im_end|>").expect("<|im_end|>");
    assert_eq!(tok.eos_token(), Some("<|im_end|>"));
    assert_eq!(tok.bos_token(), Some("<|endoftext|>"));
    assert_eq!(tok.eos_token_ids(), &[im_end, 640]);
    let out = tok.apply_chat_template(&[ChatMessage::user("body")], &ChatOptions::default()).expect("render");
    assert_eq!(out, "<|endoftext|>body<|im_end|>");
}

#[test]
fn named_templates_without_default_are_rejected() {
    let dir = ScratchDir::new("no-default");
    dir.write("tokenizer_config.json", r#"{"chat_template": [{"name": "tool_use", "template": "x"}]}"#);
    match ChatTemplate::from_dir(dir.path()) {
        Err(TextError::Template { message }) => assert!(message.contains("default"), "{message}"),
        other => panic!("expected Template, got {other:?}"),
    }
}

#[test]
fn missing_tokenizer_json_names_the_path() {
    let dir = ScratchDir::new("missing");
    let err = Tokenizer::from_dir(dir.path()).expect_err("no tokenizer.json");
    match &err {
        TextError::Io { path, source } => {
            assert_eq!(path, &dir.path().join("tokenizer.json"));
            assert_eq!(source.kind(), std::io::ErrorKind::NotFound);
        }
        other => panic!("expected Io, got {other:?}"),
    }
    assert!(err.to_string().contains("tokenizer.json"), "{err}");
}

#[test]
fn invalid_tokenizer_json_is_a_load_error() {
    let dir = ScratchDir::new("invalid");
    dir.write("tokenizer.json", r#"{"version": "1.0", "model": {"type": "Nope"}}"#);
    match Tokenizer::from_dir(dir.path()) {
        Err(TextError::TokenizerLoad { path, message }) => {
            assert_eq!(path, dir.path().join("tokenizer.json"));
            assert!(!message.is_empty());
        }
        other => panic!("expected TokenizerLoad, got {other:?}"),
    }
}

#[test]
fn malformed_config_is_a_json_error() {
    let dir = ScratchDir::new("bad-config");
    dir.copy_fixture("tokenizer.json");
    dir.write("tokenizer_config.json", "{ not json");
    match Tokenizer::from_dir(dir.path()) {
        Err(TextError::Json { path, .. }) => {
            assert_eq!(path, dir.path().join("tokenizer_config.json"));
        }
        other => panic!("expected Json, got {other:?}"),
    }

    let dir = ScratchDir::new("bad-generation-config");
    dir.copy_fixture("tokenizer.json");
    dir.write("generation_config.json", r#"{"eos_token_id": "three"}"#);
    assert!(matches!(Tokenizer::from_dir(dir.path()), Err(TextError::Json { .. })));
}

#[test]
fn dir_without_chat_template() {
    let dir = ScratchDir::new("no-template");
    dir.copy_fixture("tokenizer.json");
    dir.write("tokenizer_config.json", r#"{"eos_token": "<|im_end|>"}"#);
    match ChatTemplate::from_dir(dir.path()) {
        Err(TextError::NoChatTemplate { dir: d }) => assert_eq!(d, dir.path()),
        other => panic!("expected NoChatTemplate, got {other:?}"),
    }

    // The tokenizer itself loads fine, and its eos id comes from tokenizer_config.json alone.
    let tok = Tokenizer::from_dir(dir.path()).expect("load");
    assert!(tok.chat_template().is_none());
    let im_end = tok.token_to_id("<|im_end|>").expect("<|im_end|>");
    assert_eq!(tok.eos_token_ids(), &[im_end]);
    assert!(matches!(
        tok.apply_chat_template(&[ChatMessage::user("x")], &ChatOptions::default()),
        Err(TextError::NoChatTemplate { .. })
    ));

    // Nothing at all besides tokenizer.json: no eos ids, no template.
    let bare = ScratchDir::new("bare");
    bare.copy_fixture("tokenizer.json");
    let tok = Tokenizer::from_dir(bare.path()).expect("load");
    assert!(tok.eos_token_ids().is_empty());
    assert!(tok.chat_template().is_none());
}

#[test]
fn raise_exception_is_a_template_error() {
    let template = ChatTemplate::new(
        "{% if messages[0].role != 'user' %}{{ raise_exception('Conversation must start with a user message') }}{% endif %}ok",
        None,
        None,
    )
    .expect("compile");
    let opts = ChatOptions::default();
    assert_eq!(template.render(&[ChatMessage::user("a")], &opts).expect("render"), "ok");
    match template.render(&[ChatMessage::assistant("a")], &opts) {
        Err(TextError::Template { message }) => {
            assert!(message.contains("Conversation must start with a user message"), "{message}");
        }
        other => panic!("expected Template, got {other:?}"),
    }
}

#[test]
fn template_syntax_error_is_a_template_error() {
    assert!(matches!(
        ChatTemplate::new("{% for m in messages %}", None, None),
        Err(TextError::Template { .. })
    ));
}

#[test]
fn template_environment_matches_transformers() {
    let opts = ChatOptions { add_generation_prompt: true, enable_thinking: None };
    let msgs = [ChatMessage::user("  Hello World  ")];
    let render = |source: &str| {
        ChatTemplate::new(source, Some("<s>".into()), Some("</s>".into()))
            .expect("compile")
            .render(&msgs, &opts)
            .expect("render")
    };
    // trim_blocks + lstrip_blocks, trailing newline dropped.
    assert_eq!(
        render("{% for m in messages %}\n    {% if true %}\n[{{ m.role }}]\n    {% endif %}\n{% endfor %}\n"),
        "[user]\n"
    );
    // Python string methods; booleans print as Python prints them.
    assert_eq!(
        render(
            "{{ messages[0].content.strip() }}|{{ messages[0].content.lstrip() }}|{{ messages[0].content.split()|join(',') }}|{{ messages[0].content.strip().startswith('Hello') }}"
        ),
        "Hello World|Hello World  |Hello,World|True"
    );
    // enable_thinking undefined unless given; bos/eos defined; loop controls.
    assert_eq!(
        render(
            "{{ enable_thinking is defined }}{{ bos_token }}{{ eos_token }}{% for i in [1, 2, 3] %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}"
        ),
        "False<s></s>1"
    );
    // Python-style tojson, no HTML escaping.
    assert_eq!(
        render("{{ {'a': [1, 'x<y>'], 'b': none} | tojson }}|{{ [1, 2] | tojson(indent=2) }}"),
        "{\"a\": [1, \"x<y>\"], \"b\": null}|[\n  1,\n  2\n]"
    );
}

#[test]
fn tokenizer_and_errors_are_send_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Tokenizer>();
    assert_send_sync::<ChatTemplate>();
    assert_send_sync::<dspark::text::StreamDecoder>();
    assert_send_sync::<TextError>();
}
