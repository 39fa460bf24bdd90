"""Type stubs of the native module ``dspark._dspark`` (re-exported by ``dspark``)."""

import os
from typing import Callable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union, overload

__version__: str

def set_graphs_enabled(enabled: bool) -> None:
    """Record forwards as CUDA graphs and replay them (the default) or run them op by op.

    The output is the same either way. Process-wide, from the next forward.
    """

def graphs_enabled() -> bool:
    """Whether forwards are recorded as CUDA graphs."""

ChatMessage = Mapping[str, str]
"""``{"role": "system" | "user" | "assistant" | "tool", "content": str}``."""

TokenIds = Sequence[int]
Prompt = Union[str, TokenIds, Sequence[ChatMessage]]
"""A str (tokenized without special tokens), token ids, or chat messages (rendered with the
checkpoint's chat template and the assistant's header)."""

StrPath = Union[str, "os.PathLike[str]"]

class DsparkError(Exception):
    """Base class of every error raised by dspark."""

class IoError(DsparkError, OSError):
    """A file could not be read (``path``)."""

    path: str

class CheckpointError(DsparkError):
    """A checkpoint folder is malformed: base class of the config, JSON and weight errors."""

class JsonError(CheckpointError):
    """A JSON file is malformed or misses required keys (``path``)."""

    path: str

class ConfigError(CheckpointError):
    """A configuration value is out of range or inconsistent (``path``)."""

    path: str

class SafetensorsError(CheckpointError):
    """A safetensors file is truncated, corrupt or unreadable (``path``)."""

    path: str

class MissingTensorError(CheckpointError):
    """A tensor the model needs is absent from the checkpoint (``dir``, ``tensor``)."""

    dir: str
    tensor: str

class TensorShapeError(CheckpointError):
    """A tensor has a shape other than the config implies."""

    path: str
    tensor: str
    expected: List[int]
    actual: List[int]

class TensorDtypeError(CheckpointError):
    """A tensor has a dtype dspark cannot load (``path``, ``tensor``, ``dtype``)."""

    path: str
    tensor: str
    dtype: str

class TokenOutOfRangeError(DsparkError, ValueError):
    """A token id is not in the vocabulary (``token``, ``vocab``)."""

    token: int
    vocab: int

class InvalidInputError(DsparkError, ValueError):
    """An input is empty or malformed, or an option does not fit the engine."""

class InvalidSamplingError(DsparkError, ValueError):
    """Sampling parameters are out of range."""

class KvCacheFullError(DsparkError):
    """The KV cache budget cannot hold the requested rows."""

    needed_pages: int
    free_pages: int
    total_pages: int
    page_bytes: int
    budget_bytes: int

class UnknownSequenceError(DsparkError):
    """A sequence id is unknown to the cache (never allocated, or freed)."""

    sequence: int

class UnsupportedError(DsparkError, ValueError):
    """A device or dtype name is not recognised, or this build lacks its backend."""

class TextError(DsparkError):
    """Tokenizer or chat template failure."""

class BackendError(DsparkError, RuntimeError):
    """The backend failed while executing or reading back a tensor."""

class InternalError(DsparkError, RuntimeError):
    """A bug in dspark: a Rust panic caught at the Python boundary, or an engine left unusable
    by one."""

class SamplingParams:
    """Per-request decoding settings.

    Every argument defaults to the Rust ``SamplingParams::default()``: greedy, 64 new tokens,
    seed 0, no extra stop tokens. The values are checked when the object is made and again when
    it is used (attributes may be changed in between).

    Raises:
        InvalidSamplingError: a negative or non-finite temperature, or ``top_p`` outside (0, 1].
    """

    max_new_tokens: int
    """Upper bound on generated tokens."""
    temperature: float
    """Softmax temperature; ``0`` means greedy (argmax, lowest id on ties)."""
    top_k: int
    """Keep only the ``top_k`` largest logits (ties at the boundary kept); ``0`` disables."""
    top_p: float
    """Keep the smallest set of most likely tokens whose mass reaches ``top_p``; ``1`` disables."""
    seed: int
    """Seed of the request's coins: the same seed gives the same tokens, whatever else is in
    the batch and whether the engine speculates or not."""
    stop_token_ids: List[int]
    """Generation ends after any of these tokens (which is emitted)."""
    ignore_eos: bool
    """Do not stop at the checkpoint's end-of-sequence ids (``Engine.eos_token_ids``): only
    ``stop_token_ids`` and ``max_new_tokens`` end generation (as the Rust engine does)."""

    def __init__(
        self,
        max_new_tokens: int = 64,
        *,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        stop_token_ids: Optional[Sequence[int]] = None,
        ignore_eos: bool = False,
    ) -> None: ...
    @staticmethod
    def greedy(max_new_tokens: int) -> "SamplingParams":
        """Greedy decoding of at most ``max_new_tokens`` tokens."""
    @property
    def is_greedy(self) -> bool:
        """Whether this request decodes greedily (temperature 0)."""
    def validate(self) -> None:
        """Check ranges.

        Raises:
            InvalidSamplingError: a negative or non-finite temperature, or ``top_p`` outside
                (0, 1].
        """
    def __eq__(self, other: object) -> bool: ...

class RoundRecord:
    """One speculative round of one request."""

    @property
    def position(self) -> int:
        """Committed length before the round (the anchor's position)."""
    @property
    def drafted(self) -> List[int]:
        """Draft tokens sent to verification."""
    @property
    def accepted(self) -> int:
        """How many of them were accepted."""

class GenerationStats:
    """Per-request statistics."""

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens."""
    @property
    def generated_tokens(self) -> int:
        """Generated tokens."""
    @property
    def rounds(self) -> int:
        """Target forward passes after prefill that committed tokens (decode steps, or verify
        rounds when speculating)."""
    @property
    def drafted(self) -> int:
        """Draft tokens sent to verification."""
    @property
    def accepted(self) -> int:
        """Draft tokens accepted."""
    @property
    def tau(self) -> float:
        """τ: tokens committed per round after the first token (1 for target-only)."""
    @property
    def drafted_per_position(self) -> List[int]:
        """Rounds in which draft k (0-based) was verified."""
    @property
    def accepted_per_position(self) -> List[int]:
        """Rounds in which draft k (0-based) was accepted."""
    @property
    def round_log(self) -> List[RoundRecord]:
        """Every speculative round, in order."""

class Generation:
    """A finished request."""

    @property
    def prompt_token_ids(self) -> List[int]:
        """The prompt as token ids (text and chat prompts after tokenization)."""
    @property
    def token_ids(self) -> List[int]:
        """Generated token ids (a stop token included)."""
    @property
    def text(self) -> Optional[str]:
        """The generated tokens as text (special tokens skipped); ``None`` without a tokenizer."""
    @property
    def finish_reason(self) -> Optional[str]:
        """Why it stopped: ``"stop"`` (a stop token, in ``stop_token_id``), ``"length"``
        (``max_new_tokens`` reached) or ``None`` (``max_new_tokens`` was 0)."""
    @property
    def stop_token_id(self) -> Optional[int]:
        """The stop token when ``finish_reason`` is ``"stop"``."""
    @property
    def stats(self) -> GenerationStats:
        """Statistics."""

class BatchStats:
    """Statistics of one ``generate`` (or ``stream``) call over all its requests."""

    @property
    def forward_passes(self) -> int:
        """Target forward passes."""
    @property
    def draft_passes(self) -> int:
        """Draft forward passes."""
    @property
    def drafted(self) -> int:
        """Draft tokens sent to verification."""
    @property
    def accepted(self) -> int:
        """Draft tokens accepted."""
    @property
    def generated_tokens(self) -> int:
        """Tokens generated by all requests."""
    @property
    def prefill_time(self) -> float:
        """Seconds spent in the prefill forward."""
    @property
    def decode_time(self) -> float:
        """Seconds spent after prefill."""
    @property
    def decode_tokens_per_second(self) -> float:
        """Generated tokens per second of decode time (prefill excluded)."""
    @property
    def draft_time(self) -> float:
        """Of the decode time, speculative rounds only: seconds in the draft's proposals."""
    @property
    def verify_time(self) -> float:
        """Of the decode time, speculative rounds only: seconds in the target's verify
        forwards, logits read back included."""
    @property
    def commit_time(self) -> float:
        """Of the decode time, speculative rounds only: seconds of acceptance, commits and the
        draft's context update."""
    @property
    def one_sync_rounds(self) -> int:
        """Speculative rounds that waited on the device once (CUDA with recorded graphs).
        Their draft time is the time to queue the draft round; the draft's device time counts
        in ``verify_time``."""
    @property
    def preemptions(self) -> int:
        """Requests preempted under KV pressure (their KV freed, later resumed by recomputing
        it)."""
    @property
    def prefill_tokens(self) -> int:
        """Prompt and resumed rows recomputed by prefills."""
    @property
    def peak_lanes(self) -> int:
        """Most lanes decoded together in one round."""

class StreamChunk:
    """Tokens newly committed for one request, as ``Engine.stream`` produces them."""

    @property
    def request(self) -> int:
        """Index of the request among the prompts of the call (0 for a single prompt)."""
    @property
    def token_ids(self) -> List[int]:
        """The new tokens."""
    @property
    def text(self) -> Optional[str]:
        """The text they complete (special tokens skipped; a character split over tokens comes
        with its last token); ``None`` without a tokenizer. The chunks' texts of a request add
        up to its ``Generation.text``."""
    @property
    def finish_reason(self) -> Optional[str]:
        """Set on the request's last chunk, as in ``Generation.finish_reason``."""
    @property
    def stop_token_id(self) -> Optional[int]:
        """The stop token when ``finish_reason`` is ``"stop"``."""

class TokenStream(Iterator[StreamChunk]):
    """An iterator of ``StreamChunk``s, from ``Engine.stream``. Also a context manager that
    closes it."""

    def __iter__(self) -> "TokenStream": ...
    def __next__(self) -> StreamChunk: ...
    @property
    def results(self) -> Optional[List[Generation]]:
        """The finished requests, in prompt order, once the iteration has ended; ``None``
        before, and when the stream failed or was closed early."""
    def close(self) -> None:
        """Stop listening: iteration ends. A generation still running finishes in the
        background."""
    def __enter__(self) -> "TokenStream": ...
    def __exit__(self, *args: object) -> bool: ...

class Engine:
    """A Qwen3 target checkpoint, optionally with a DSpark draft (speculative decoding: same
    outputs when greedy, the same distribution when sampling), and the tokenizer of its folder.

    Every call releases the GIL while it works; calls on one engine are serialised by a lock (a
    running ``stream`` holds it until its generation ends).

    Args:
        target: Hugging Face Qwen3 folder (``config.json``, ``model.safetensors`` or shards with
            ``model.safetensors.index.json``, optionally ``tokenizer.json``,
            ``tokenizer_config.json``, ``generation_config.json``).
        draft: DSpark draft folder; ``None`` runs target-only.
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
        dtype: compute dtype, ``"f32"``, ``"bf16"`` or ``"f16"``.
        kv_budget_bytes: bytes of device memory for the target's KV cache (default: the Rust
            ``EngineConfig`` default).
        page_size: rows per KV page (default: the Rust default).
        verify_width: verify the anchor and the first ``verify_width - 1`` drafts each round
            (``1..=γ+1``); default: all γ drafts. Needs ``draft``.
        confidence_threshold: verify the drafts before the first whose confidence is below this
            value (needs a draft with a confidence head). Needs ``draft``; not with
            ``verify_width``.
        draft_kv_budget_bytes: bytes for the draft's context K/V (default: the Rust
            ``DraftCacheConfig`` default).
        draft_page_size: rows per page of the draft's cache (default: the Rust default).
        draft_fp8: quantise the draft's projections to FP8 (e4m3, one scale per output row) at
            load; projections the checkpoint stores in FP8 are used as stored. On CUDA in bf16
            they stay FP8 on the device (half the bytes per round). Outputs keep the target's
            distribution; acceptance may drop a little. Needs ``draft``.
        draft_fp8_head: also give the draft an FP8 copy of the LM head for its base logits (the
            target's logits stay exact). Needs ``draft_fp8``.
        draft_vocab: let the draft propose only some tokens (a draft vocabulary: fewer LM-head
            and Markov rows read per round; outputs keep the target's distribution, acceptance
            may fall): a number of tokens (the most frequent in ``draft_vocab_corpus``, else the
            first ids) or the token ids themselves (filled up to a multiple of 64 with the
            lowest ids missing). Needs ``draft``.
        draft_vocab_corpus: a text file, or a folder read recursively, whose token counts rank
            the draft vocabulary. Needs ``draft_vocab`` as a number and a tokenizer.
        one_sync_rounds: let fixed-width rounds wait on the device once (drafts merged into the
            verify on the device; CUDA with recorded graphs); ``False`` reads the drafts before
            the verify. Outputs are the same either way.
        tokenizer: folder with ``tokenizer.json`` (and its configs); default: ``target``, where
            a missing ``tokenizer.json`` leaves the engine without a tokenizer (token ids only).
        progress: called as ``progress(bytes_loaded, bytes_total)`` while weights load.

    Raises:
        UnsupportedError: an unknown device or dtype, or a device this build lacks.
        IoError, CheckpointError: a folder or file is missing or malformed.
        InvalidInputError: the verify or FP8 options do not fit the draft, or the KV budget
            holds no page.
        TextError: the tokenizer files are malformed.
    """

    def __init__(
        self,
        target: StrPath,
        draft: Optional[StrPath] = None,
        *,
        device: str = "cpu",
        dtype: str = "f32",
        kv_budget_bytes: Optional[int] = None,
        page_size: Optional[int] = None,
        verify_width: Optional[int] = None,
        confidence_threshold: Optional[float] = None,
        draft_kv_budget_bytes: Optional[int] = None,
        draft_page_size: Optional[int] = None,
        draft_fp8: bool = False,
        draft_fp8_head: bool = False,
        draft_vocab: Union[int, Sequence[int], None] = None,
        draft_vocab_corpus: Optional[StrPath] = None,
        one_sync_rounds: bool = True,
        tokenizer: Optional[StrPath] = None,
        progress: Optional[Callable[[int, int], None]] = None,
    ) -> None: ...
    @overload
    def generate(
        self,
        prompts: Union[str, TokenIds, Sequence[ChatMessage]],
        params: Optional[SamplingParams] = None,
        *,
        enable_thinking: Optional[bool] = None,
    ) -> Generation:
        """Generate continuations.

        Args:
            prompts: one prompt or a list of prompts, generated together. A prompt is a str
                (tokenized without special tokens), a list of token ids, or a list of chat
                messages ``{"role": ..., "content": ...}`` (rendered with the checkpoint's chat
                template and the assistant's header). Text needs a tokenizer.
            params: one ``SamplingParams`` for every prompt, a list with one per prompt, or
                ``None`` for the defaults.
            enable_thinking: for chat prompts, Qwen3's thinking switch (``False`` renders the
                empty think block); left to the template when ``None``.

        Returns:
            A ``Generation`` for one prompt, a list of them (in order) for a list.

        Raises:
            InvalidInputError: an empty prompt, text without a tokenizer, mismatched params.
            TokenOutOfRangeError: a token id outside the vocabulary.
            InvalidSamplingError: out-of-range sampling parameters.
            KvCacheFullError: a request could never fit the KV budget, even alone (requests
                that fit alone but not together wait for room).
            TextError: tokenization or the chat template failed.
        """
    @overload
    def generate(
        self,
        prompts: Sequence[Prompt],
        params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        *,
        enable_thinking: Optional[bool] = None,
    ) -> List[Generation]: ...
    def stream(
        self,
        prompts: Union[Prompt, Sequence[Prompt]],
        params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        *,
        enable_thinking: Optional[bool] = None,
    ) -> TokenStream:
        """Generate as ``generate`` does, yielding tokens as they are committed.

        Generation runs on a background thread; iterating waits (with the GIL released) for
        the next ``StreamChunk``. After the last chunk, ``TokenStream.results`` holds the
        ``Generation``s. Errors of the generation itself are raised by the iteration. Dropping
        or closing the stream early is safe: the engine finishes the call in the background
        (its lock is held until then).

        Raises:
            InvalidInputError, TextError, TokenOutOfRangeError: when the prompts cannot be
                prepared (at once; later errors come from the iteration).
        """
    def score(self, tokens: Union[str, TokenIds]) -> List[float]:
        """Log-probability of every token after the first, given the tokens before it (raw
        target distribution: temperature 1, no filtering).

        Args:
            tokens: token ids, or a str (tokenized without special tokens; needs a tokenizer).

        Returns:
            ``len(tokens) - 1`` floats.

        Raises:
            InvalidInputError: fewer than two tokens.
            TokenOutOfRangeError: a token id outside the vocabulary.
            KvCacheFullError: the sequence does not fit the KV budget.
        """
    def submit(
        self,
        prompt: Prompt,
        params: Optional[SamplingParams] = None,
        *,
        enable_thinking: Optional[bool] = None,
    ) -> int:
        """Queue one request for the serving calls; it starts at a later ``step`` when it fits
        the KV budgets. Returns its id.

        Raises:
            InvalidInputError, TokenOutOfRangeError, InvalidSamplingError, TextError: as for
                ``generate``.
            KvCacheFullError: the request could never fit the KV budget, even alone.
        """
    def step(self) -> Tuple[List[StreamChunk], List[Tuple[int, Generation]]]:
        """One serving step: admit queued requests that fit the KV budgets, then run one round
        (a decode step, or draft → verify → accept) over every running request. Requests join
        and leave between steps; under KV pressure the engine preempts and later resumes
        requests without changing their output.

        Returns:
            ``(chunks, finished)``: the ``StreamChunk``s of this step (their ``request`` is the
            id from ``submit``), and ``(id, Generation)`` for every request that finished in it.
        """
    def cancel(self, id: int) -> Generation:
        """Stop a submitted request now, freeing its KV at once; returns its ``Generation`` so
        far, with ``finish_reason`` ``"cancelled"``.

        Raises:
            InvalidInputError: no unfinished submitted request has this id.
        """
    def pending(self) -> Tuple[int, int]:
        """Requests running now (holding KV) and waiting for admission: ``(running, waiting)``."""
    def encode(self, text: str) -> List[int]:
        """Token ids of ``text`` (no special tokens added; special tokens written in the text,
        such as ``<|im_start|>``, become their ids).

        Raises:
            InvalidInputError: the engine has no tokenizer.
            TextError: encoding failed.
        """
    def decode(self, token_ids: TokenIds, skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids``, leaving out special tokens when ``skip_special_tokens``.

        Raises:
            InvalidInputError: the engine has no tokenizer.
            TextError: an id is not in the tokenizer's vocabulary, or decoding failed.
        """
    def apply_chat_template(
        self,
        messages: Sequence[ChatMessage],
        add_generation_prompt: bool = True,
        enable_thinking: Optional[bool] = None,
    ) -> str:
        """Render a conversation with the checkpoint's chat template, as
        ``apply_chat_template(messages, tokenize=False, ...)`` in ``transformers``.

        Raises:
            InvalidInputError: the engine has no tokenizer, or a message is malformed.
            TextError: the folder has no chat template, or rendering failed.
        """
    @property
    def is_speculative(self) -> bool:
        """Whether this engine speculates (was given a draft)."""
    @property
    def vocab_size(self) -> int:
        """The target's vocabulary size (rows of its embedding)."""
    @property
    def device(self) -> str:
        """The device, as ``"cpu"`` or ``"cuda:N"``."""
    @property
    def dtype(self) -> str:
        """The compute dtype, as ``"f32"``, ``"bf16"`` or ``"f16"``."""
    @property
    def has_tokenizer(self) -> bool:
        """Whether a tokenizer is loaded (text and chat prompts, ``text`` in results)."""
    @property
    def eos_token_ids(self) -> List[int]:
        """The checkpoint's end-of-sequence ids (``config.json``, then the tokenizer's
        ``eos_token`` and ``generation_config.json``), which end generation unless
        ``SamplingParams.ignore_eos``."""
    @property
    def last_stats(self) -> BatchStats:
        """Statistics of the last ``generate`` (or finished ``stream``) call."""
