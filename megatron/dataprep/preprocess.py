"""`tools/preprocess_data.py`: JSON lines (or a saved HF dataset) -> megatron `.bin/.idx`.

The main process reads raw lines and writes results in input order; worker processes
decode, parse and tokenize. Flags follow Megatron-LM's tool.
"""

import argparse
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
import warnings
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager

from megatron.dataprep import preprocess_flags
from megatron.dataprep.inputs import InputError, check_columns, iter_chunks, resolve_inputs
from megatron.dataprep.names import REFUSED_TOKENIZER_TYPES, TOKENIZER_TYPES

PROG = "preprocess_data.py"


class UsageError(ValueError):
    """A flag is missing or wrong; raised before any input is read."""


class DataError(RuntimeError):
    """Bad input under --strict, or nothing left to write."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not the whole usage block
        print(f"{PROG}: error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description=__doc__.splitlines()[0])
    g = p.add_argument_group("input data")
    g.add_argument("--input", required=True, nargs="+",
                   help="JSONL file(s) (.gz too), a quoted glob, or a save_to_disk directory")
    g.add_argument("--json-keys", nargs="+", default=["text"],
                   help="keys to extract; each gets its own output (default: text)")
    g.add_argument("--split-sentences", action="store_true",
                   help="split documents into sentences (nltk Punkt, no download)")
    g.add_argument("--keep-newlines", action="store_true",
                   help="with --split-sentences, keep the whitespace between sentences")
    g.add_argument("--lang", default="english",
                   help="the language of --split-sentences' Punkt model: english is built in "
                        "(default); another needs nltk's punkt_tab data for it installed")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True,
                   help=f"one of {', '.join(t for t in TOKENIZER_TYPES if t != 'SFTTokenizer')}")
    g.add_argument("--vocab-file", help="GPT-2 vocab.json (GPT2BPETokenizer)")
    g.add_argument("--merge-file", help="GPT-2 merges.txt (GPT2BPETokenizer)")
    g.add_argument("--tokenizer-model", help="HF tokenizer.json or its directory")
    g.add_argument("--vocab-size", type=int,
                   help="NullTokenizer: ids 0..N-1, eod N - 1 (as Megatron-LM 0.18+)")
    g.add_argument("--null-tokenizer-eod-id", type=int,
                   help="NullTokenizer's end-of-document id (default --vocab-size - 1)")
    g.add_argument("--null-tokenizer-pad-id", type=int, default=-1,
                   help="NullTokenizer's pad id (default -1: none; not written here)")
    g.add_argument("--tokenizer-special-tokens", "--tiktoken-special-tokens", nargs="+",
                   dest="special_tokens", metavar="TOKEN",
                   help="as Megatron-LM: tokens added to a HuggingFaceTokenizer or "
                        "GPT2BPETokenizer as special (whole) tokens, those the vocabulary "
                        "lacks appended (give training the same)")
    g.add_argument("--append-eod", action="store_true",
                   help="append the end-of-document token to every document")
    g.add_argument("--tokenizer-hf-no-include-special-tokens", action="store_false",
                   dest="include_special_tokens",
                   help="as Megatron-LM: HF tokenizers encode without their special tokens "
                        "(e.g. no BOS from the tokenizer's post-processor)")
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True,
                   help="writes <prefix>_<key>_document.bin/.idx (or _sentence)")
    g.add_argument("--dataset-impl", default="mmap",
                   help="accepted for compatibility; only mmap exists in megatron-core")
    g.add_argument("--strict", action="store_true",
                   help="stop at the first bad input line instead of skipping it")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="encoding processes (default 1)")
    g.add_argument("--chunk-size", type=int, default=64,
                   help="documents per task sent to a worker (default 64; a task also "
                        "ends at 256 KB of input)")
    g.add_argument("--log-interval", type=int, default=1000,
                   help="print progress every this many documents (default 1000)")
    g.add_argument("--partitions", type=int, default=1,
                   help="as Megatron-LM with --keep-sequential-samples: the documents keep the "
                        "input order; --workers alone sets the parallelism here")
    g.add_argument("--keep-sequential-samples", action="store_true",
                   help="as Megatron-LM: the documents keep the input order (always so here)")
    preprocess_flags.add_to(p)
    return p


def output_prefix(args, key: str) -> str:
    level = "sentence" if args.split_sentences else "document"
    return f"{args.output_prefix}_{key}_{level}"


def check_args(args):
    """Everything a user can get wrong, before reading any input. Returns the sources."""
    refused = preprocess_flags.refused(args)
    if args.partitions > 1 and not args.keep_sequential_samples:
        refused.append(f"--partitions {args.partitions}: Megatron-LM then merges its partitions "
                       f"in round-robin order of the input lines; this tool writes the input "
                       f"order (Megatron-LM's --keep-sequential-samples) and parallelises with "
                       f"--workers: add --keep-sequential-samples or drop --partitions")
    if refused:
        raise UsageError("; ".join(refused))
    if args.partitions < 1:
        raise UsageError(f"--partitions: must be at least 1, got {args.partitions}")
    for note in preprocess_flags.noted(args):
        print(f"{PROG}: note: {note}", file=sys.stderr)
    if args.tokenizer_type in REFUSED_TOKENIZER_TYPES:
        raise UsageError(f"--tokenizer-type {args.tokenizer_type} is refused: "
                         f"{REFUSED_TOKENIZER_TYPES[args.tokenizer_type]}")
    if args.tokenizer_type == "SFTTokenizer":
        raise UsageError("--tokenizer-type SFTTokenizer: SFT data is not preprocessed; the "
                         "trainer's --sft reads the JSON-lines conversation files themselves "
                         "(--data-path chat.jsonl)")
    if args.tokenizer_type not in TOKENIZER_TYPES:
        raise UsageError(f"--tokenizer-type: unknown {args.tokenizer_type!r}; choose one of "
                         f"{', '.join(TOKENIZER_TYPES)}")
    if args.dataset_impl != "mmap":
        raise UsageError(f"--dataset-impl: {args.dataset_impl!r} is not supported; megatron-core "
                         f"reads only mmap (drop the flag or pass mmap)")
    for flag, value in (("--workers", args.workers), ("--chunk-size", args.chunk_size),
                        ("--log-interval", args.log_interval)):
        if value < 1:
            raise UsageError(f"{flag}: must be at least 1, got {value}")
    if len(set(args.json_keys)) != len(args.json_keys):
        raise UsageError(f"--json-keys: {' '.join(args.json_keys)} names a key twice")
    if args.keep_newlines and not args.split_sentences:  # harmless: Megatron-LM ignores it
        print(f"{PROG}: warning: --keep-newlines has no effect without --split-sentences "
              f"(documents keep their newlines anyway)", file=sys.stderr)
    if args.split_sentences:
        _check_sentence_splitter(args.lang)
    if args.tokenizer_type == "GPT2BPETokenizer":
        _need_file(args.vocab_file, "--vocab-file", "GPT-2 vocab.json")
        _need_file(args.merge_file, "--merge-file", "GPT-2 merges.txt")
    elif args.tokenizer_type == "HuggingFaceTokenizer" and not args.tokenizer_model:
        raise UsageError("--tokenizer-model: HuggingFaceTokenizer needs a tokenizer.json "
                         "file or a directory holding one")
    elif args.tokenizer_type == "NullTokenizer" and (args.vocab_size or 0) < 1:
        raise UsageError("--vocab-size: NullTokenizer needs --vocab-size N (ids 0..N-1)")
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    if not os.path.isdir(out_dir):
        raise UsageError(f"--output-prefix: directory {out_dir} does not exist; "
                         f"create it first (mkdir -p {out_dir})")
    if not os.access(out_dir, os.W_OK):
        raise UsageError(f"--output-prefix: directory {out_dir} is not writable")
    sources = resolve_inputs(args.input)
    check_columns(sources, args.json_keys)
    return sources


def _check_sentence_splitter(lang):
    """--split-sentences needs nltk (and, for a --lang other than english, its data): say
    so here, in one line, rather than let every worker fail to load it (which reads as "a
    preprocessing worker died")."""
    try:
        from megatron.dataprep.sentences import SentenceSplitter

        SentenceSplitter(lang=lang)
    except ImportError as exc:
        raise UsageError(f"--split-sentences needs the nltk package (Punkt sentence "
                         f"splitting): pip install nltk ({exc})") from None
    except LookupError:
        raise UsageError(f"--lang {lang}: nltk's Punkt model for {lang} (punkt_tab) is not "
                         f"installed and nothing is downloaded here; install nltk_data's "
                         f"punkt_tab offline, or use --lang english (built in)") from None


def _need_file(path, flag, what):
    if not path:
        raise UsageError(f"{flag}: required by GPT2BPETokenizer ({what}; "
                         f"tools/train_tokenizer.py writes one)")
    if not os.path.isfile(path):
        raise UsageError(f"{flag}: {path} does not exist (expected {what})")


def _tokenizer_args(args) -> dict:
    return dict(tokenizer_type=args.tokenizer_type, vocab_file=args.vocab_file,
                merge_file=args.merge_file, tokenizer_model=args.tokenizer_model,
                vocab_size=args.vocab_size, include_special_tokens=args.include_special_tokens,
                special_tokens=args.special_tokens, null_eod_id=args.null_tokenizer_eod_id,
                null_pad_id=args.null_tokenizer_pad_id)


def load_tokenizer(args):
    with _quiet():
        from megatron.dataprep.tokenizer import build_tokenizer
    tokenizer = build_tokenizer(**_tokenizer_args(args))
    if args.append_eod:
        try:
            tokenizer.eod
        except NotImplementedError as exc:
            raise UsageError(f"--append-eod: {exc}") from None
    return tokenizer


# ---- worker processes -----------------------------------------------------------------

_ENCODER = None


def _init_worker(spec: dict, main_pid: int) -> None:
    global _ENCODER
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process handles Ctrl-C
    # forked with SIGTERM blocked (_fork_environment): a worker dies on it, at once
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker: --workers means cores
    threading.Thread(target=_exit_with, args=(main_pid,), daemon=True).start()
    _ENCODER = _make_encoder(spec)


def _exit_with(main_pid: int) -> None:
    # A main process killed with SIGKILL cannot stop its workers, and they would wait for
    # tasks forever: each one leaves once it is re-parented.
    while os.getppid() == main_pid:
        time.sleep(1)
    os._exit(1)


def _encode_chunk(chunk):
    return _ENCODER(chunk)


def _make_encoder(spec: dict):
    from megatron.dataprep.encode import ChunkEncoder
    from megatron.dataprep.tokenizer import build_tokenizer

    splitter = None
    if spec["split_sentences"]:
        from megatron.dataprep.sentences import SentenceSplitter

        splitter = SentenceSplitter(keep_newlines=spec["keep_newlines"], lang=spec["lang"])
    return ChunkEncoder(build_tokenizer(**spec["tokenizer"]), spec["keys"], spec["dtype"],
                        append_eod=spec["append_eod"], splitter=splitter)


class WorkerDied(RuntimeError):
    """A worker process ended without returning its task (killed, out of memory, crashed)."""


# Why concurrent.futures rather than multiprocessing.Pool: Pool silently replaces a dead
# worker and the task it held never completes, so the main process waited forever. The
# executor notices a dead worker and fails every pending task with BrokenProcessPool.
_POLL_S = 0.5  # how often the main process looks at its workers while it waits
_GRACE_S = 3.0  # how long the executor gets to report a dead worker before we do


class _Workers:
    """Forked encoding processes; results by future, a dead worker raises WorkerDied."""

    def __init__(self, workers: int, spec: dict):
        before = set(multiprocessing.active_children())
        with _fork_environment():
            self.executor = ProcessPoolExecutor(
                workers, mp_context=multiprocessing.get_context("fork"),
                initializer=_init_worker, initargs=(spec, os.getpid()))
            # CPython forks every worker at the first submit when the context is fork;
            # doing it here forks them under _fork_environment and lets us list them.
            self.executor.submit(os.getpid)
        self.processes = [p for p in multiprocessing.active_children() if p not in before]
        self._death_seen_at = None
        self._ended_first = []

    def submit(self, chunk):
        try:
            return self.executor.submit(_encode_chunk, chunk)
        except BrokenProcessPool:
            raise WorkerDied() from None

    def result(self, future):
        while True:
            try:
                return future.result(timeout=_POLL_S)
            except FutureTimeout:
                self._check_alive()
            except BrokenProcessPool:
                raise WorkerDied() from None

    def _check_alive(self) -> None:
        # Safety net for the case the executor cannot see: a worker killed while sending
        # its result leaves half a message that the executor's reader waits on forever.
        if all(p.exitcode is None for p in self.processes):
            return
        now = time.monotonic()
        self._death_seen_at = self._death_seen_at or now
        if now - self._death_seen_at > _GRACE_S:
            raise WorkerDied()

    def close(self) -> None:
        """Finish the tasks already running (at most one window), then end the workers."""
        self.executor.shutdown(wait=True, cancel_futures=True)

    def kill(self) -> None:
        """Stop now: on an interrupt, or when a worker died and the pool may be stuck."""
        # The main process's end of the result pipe (a CPython internal, hence getattr):
        # once it and every worker are gone, a half-sent result reads as end-of-file and
        # the executor's thread stops instead of waiting for the rest of the message.
        writer = getattr(getattr(self.executor, "_result_queue", None), "_writer", None)
        # Who had died before we kill anyone (exit codes are read once all are reaped).
        ended = multiprocessing.connection.wait([p.sentinel for p in self.processes], 0)
        self._ended_first = [p for p in self.processes if p.sentinel in ended]
        for p in self.processes:
            p.kill()
        for p in self.processes:
            p.join(timeout=5)
        if writer is not None:
            writer.close()
        self.executor.shutdown(wait=True, cancel_futures=True)

    def death_line(self) -> str:
        """What happened to the worker that died, for the one-line error."""
        dead = [p for p in self._ended_first if p.exitcode not in (None, 0)]
        # After one death the executor ends the others with SIGTERM: prefer another cause.
        p = next((p for p in dead if p.exitcode != -signal.SIGTERM), dead[0] if dead else None)
        if p is None:
            return "a preprocessing worker died"
        if p.exitcode > 0:
            how = f"exited with code {p.exitcode}"
        else:
            how = f"killed by signal {-p.exitcode}{_signal_name(-p.exitcode)}"
            if p.exitcode == -signal.SIGKILL:
                how += ", out of memory?"
        return f"a preprocessing worker (pid {p.pid}) died ({how})"


def _signal_name(number: int) -> str:
    try:
        return f" ({signal.Signals(number).name})"
    except ValueError:  # a real-time signal has no name
        return ""


@contextmanager
def _fork_environment():
    # TOKENIZERS_PARALLELISM set at fork time keeps HF tokenizers from warning about a fork
    # after the parent used its thread pool. Workers must die on SIGTERM: forked with the
    # main process's SIGTERM -> KeyboardInterrupt handler they could hang in a queue lock.
    # So SIGTERM is blocked while forking (the workers unblock it with its default action
    # in _init_worker): one sent to the main process meanwhile waits for its handler
    # instead of killing it without cleanup (as SIG_DFL here once did).
    old = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        if old is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = old


@contextmanager
def _worker_pool(workers: int, spec: dict):
    pool = _Workers(workers, spec)
    try:
        yield pool
    except WorkerDied:
        pool.kill()
        raise WorkerDied(f"{pool.death_line()}; no output written, rerun") from None
    except KeyboardInterrupt:
        pool.kill()
        raise
    except BaseException:
        pool.close()  # an error in the main process: the workers are fine, let them finish
        raise
    else:
        pool.close()


def _ordered(pool, chunks, window: int):
    """Results in input order, with at most `window` chunks in flight (bounded memory)."""
    pending = deque()
    for chunk in chunks:
        pending.append(pool.submit(chunk))
        if len(pending) >= window:
            yield pool.result(pending.popleft())
    while pending:
        yield pool.result(pending.popleft())


# ---- the run --------------------------------------------------------------------------

def run(args, sources, tokenizer):
    """Preprocess; returns the Report. Raises DataError; leaves no output on any failure."""
    from megatron.core.datasets.indexed_dataset import DType

    from megatron.dataprep.report import Report
    from megatron.dataprep.writer import AtomicIndexedWriter

    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    spec = dict(tokenizer=_tokenizer_args(args), keys=args.json_keys, dtype=dtype,
                append_eod=args.append_eod, split_sentences=args.split_sentences,
                keep_newlines=args.keep_newlines, lang=args.lang)
    report = Report(args.json_keys, args.log_interval)
    for key in args.json_keys:
        _remove_leftovers(output_prefix(args, key))
    writers = {}
    try:
        for key in args.json_keys:
            writers[key] = AtomicIndexedWriter(output_prefix(args, key), dtype)
        with _worker_pool(args.workers, spec) as pool:
            chunks = iter_chunks(sources, args.json_keys, args.chunk_size)
            for result in _ordered(pool, chunks, window=4 * args.workers):
                _consume(result, sources[result.source], writers, report, args.strict)
        for key, writer in writers.items():
            if writer.documents == 0:
                raise DataError(f"no document left to write for key {key!r}"
                                f"{report.skip_reasons(key)}; nothing written")
        for writer in writers.values():
            writer.finalize()
        for writer in writers.values():
            writer.publish()
    except BaseException as exc:
        for writer in writers.values():
            writer.abort()
        # what the error line says is left: "nothing written" unless publishing had begun
        exc.outputs_left = [left for left in (w.left_behind() for w in writers.values()) if left]
        raise
    report.summary({k: output_prefix(args, k) for k in args.json_keys})
    return report


def _remove_leftovers(prefix: str) -> None:
    """Delete the temporary files of a killed run; name each one, and any still in use."""
    from megatron.dataprep.writer import leftover_temporaries

    for path, pid, running in leftover_temporaries(prefix):
        if running:
            print(f"{PROG}: warning: left {path} alone: process {pid} is running (another "
                  f"run writing the same --output-prefix?)", file=sys.stderr)
        else:
            os.remove(path)
            print(f"{PROG}: removed leftover temp file {path} from an interrupted run",
                  file=sys.stderr)


def _consume(result, source, writers, report, strict: bool) -> None:
    if strict and result.skips:
        s = result.skips[0]
        key = f" (key {s.key!r})" if s.key else ""
        detail = f": {s.detail}" if s.detail else ""
        raise DataError(f"--strict: {source.where(s.number)}{key}: {s.reason}{detail}; "
                        f"stopped, nothing written (drop --strict to skip such lines)")
    for s in result.skips:
        for key in ([s.key] if s.key else writers):
            report.skip(key, s.reason, source.where(s.number))
    for key, out in result.outputs.items():
        writer = writers[key]
        ids, lengths, at, seq = out.ids, out.sequence_lengths, 0, 0
        for count in out.sequences_per_document.tolist():
            lens = lengths[seq:seq + count]
            size = int(lens.sum())
            writer.add_document(ids[at:at + size], lens.tolist())
            at += size
            seq += count
        report.written[key] = writer.documents
        report.tokens[key] = writer.tokens
    report.advance(result.items, result.text_bytes)


@contextmanager
def _quiet():
    # megatron-core warns at import about optional GPU libraries a CPU machine lacks.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


class _Terminated(KeyboardInterrupt):
    """SIGTERM, handled like Ctrl-C."""


def _raise_terminated(signum, frame):
    raise _Terminated()


def _outputs_left(exc) -> str:
    """"nothing written", or what a failure while publishing left (`run`)."""
    return "; ".join(getattr(exc, "outputs_left", ())) or "nothing written"


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        sources = check_args(args)
        tokenizer = load_tokenizer(args)
    except (UsageError, InputError, ValueError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    old_term = signal.signal(signal.SIGTERM, _raise_terminated)  # clean up on kill too
    try:
        run(args, sources, tokenizer)
    except (DataError, WorkerDied) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # a full disk, a quota, a directory that went away
        outputs = ", ".join(f"{output_prefix(args, key)}.{{bin,idx}}" for key in args.json_keys)
        where = f" ({exc.filename})" if exc.filename else ""
        print(f"{PROG}: error: writing {outputs} failed: {exc.strerror or exc}{where}; "
              f"temporary files removed, {_outputs_left(exc)}: free space or choose another "
              f"--output-prefix", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        what = "stopped by SIGTERM" if isinstance(exc, _Terminated) else "interrupted"
        print(f"{PROG}: {what}; temporary files removed, {_outputs_left(exc)}", file=sys.stderr)
        return 128 + signal.SIGTERM if isinstance(exc, _Terminated) else 130
    finally:
        signal.signal(signal.SIGTERM, old_term)
    return 0
