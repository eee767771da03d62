"""GrammarCompiler: constraints compiled in a thread pool, off the step loop, cached by grammar text."""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance

from kvforge.structured_output.deferred import DeferredMatcher
from kvforge.structured_output.matcher import GrammarMatcher
from kvforge.structured_output.params import StructuredOutputParams
from kvforge.tokenizer import Tokenizer

# JSON as compact as the schema allows: one space after ":" and ",", no newlines or indentation (a model
# free to choose its whitespace can spend its whole budget on it).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_KIND_NAMES = {"json": "JSON schema", "regex": "regex", "choice": "choice list", "grammar": "grammar"}


class CompiledGrammar:
    """A compiled constraint: every request using it starts from a copy of one fresh matcher."""

    __slots__ = ("_prototype", "_token_text")

    def __init__(self, prototype: llguidance.LLMatcher, token_text: Callable[[int], str]) -> None:
        self._prototype = prototype
        self._token_text = token_text  # a token id's text, to find a starts_after marker

    def matcher(self, starts_after: str | None = None) -> GrammarMatcher | DeferredMatcher:
        """A fresh matcher; with starts_after, one that applies the grammar only after that text."""
        matcher = GrammarMatcher(self._prototype.deep_copy())
        return matcher if starts_after is None else DeferredMatcher(matcher, starts_after, self._token_text)


class GrammarCompiler:
    """Compiles StructuredOutputParams for one tokenizer, in worker threads.

    `compile` returns at once with a future; equal constraints share one compilation (the cache holds
    the `max_cached` most recently used, failures included, so a bad grammar fails fast the second
    time). The grammar library's view of the vocabulary is built once, by the first compilation.
    A grammar that cannot be compiled, or a schema feature the library does not implement, fails the
    future with a ValueError saying why.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_workers: int = 2, max_cached: int = 512) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = max(vocab_size, tokenizer.vocab_size)  # the logits' width: the bitmask's too
        self.max_cached = max_cached
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="kvforge-grammar")
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Future[CompiledGrammar]] = OrderedDict()
        self._vocabulary: Future[llguidance.LLTokenizer] | None = None

    @property
    def bitmask_words(self) -> int:
        return -(-self.vocab_size // 32)

    def compile(self, params: StructuredOutputParams) -> Future[CompiledGrammar]:
        key = params.grammar_source()
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            if self._vocabulary is None:  # NOTE: queued first, so no compilation waits on a later job
                self._vocabulary = self._pool.submit(self._build_vocabulary)
            future = self._pool.submit(self._compile, *key)
            self._cache[key] = future
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
            return future

    def shutdown(self) -> None:
        # NOTE: an engine still referenced when the interpreter exits shuts down after concurrent.futures's module
        # globals are torn down, where cancelling the queued jobs fails ("Exception ignored in ... __del__")
        self._pool.shutdown(wait=False, cancel_futures=not sys.is_finalizing())

    def _build_vocabulary(self) -> llguidance.LLTokenizer:
        eos = sorted(self.tokenizer.eos_token_ids)
        return llguidance.LLTokenizer(self.tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                                      eos_token=eos or None)

    def _compile(self, kind: str, text: str) -> CompiledGrammar:
        assert self._vocabulary is not None
        vocabulary = self._vocabulary.result()
        try:
            if kind == "json":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
            else:
                grammar = llguidance.grammar_from(kind, text)
        except ValueError as error:
            raise ValueError(f"the {_KIND_NAMES[kind]} cannot be compiled: {error}") from None
        matcher = llguidance.LLMatcher(vocabulary, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"the {_KIND_NAMES[kind]} cannot be compiled: {matcher.get_error()}")
        return CompiledGrammar(matcher, self._token_text)

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)
