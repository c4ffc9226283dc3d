"""Packed-document data whose split cases are known, and a check that a run met them.

Mock data's documents are 1-4095 tokens long, so in 48-token rows the cases that matter
for split attention (a document crossing a split edge, one shorter than a split, a
boundary exactly at a split edge, one document spanning every split) appear by chance,
if at all. `write_document_corpus` writes a small `.bin/.idx` corpus whose entries are
exactly one row long: the GPT dataset cuts rows at multiples of the sequence length of
its shuffled entries, so every row the model sees is one of the `ROWS` below (in an
order the seed decides). `document_cases` reads, from the rows a run actually trained
on (recorded by `dist_runner.py`), which cases it met, so a test can assert them.
"""

import numpy

# the documents of each row type (their lengths in tokens, EOD included), 48 tokens each
ROWS = [
    [48],                     # one document spanning every split (and the row)
    [2] * 24,                 # short documents: a boundary at every even position
    [1] + [2] * 23 + [1],     # ... and at every odd one (a lone EOD is a 1-token document)
    [5, 30, 13],              # documents crossing split edges, one shorter than a split
    [20, 3, 9, 16],
    [11, 26, 7, 4],
]
# where a test's flags name this, `with_corpus` puts the corpus's path
DOCUMENT_DATA = "<document corpus>"
DOCUMENT_FLAGS = ["--data-path", DOCUMENT_DATA, "--split", "90,10,0"]
CASES = ("crosses a split edge", "boundary at a split edge", "shorter than its split",
         "spans every split")


def write_document_corpus(prefix: str, vocab_size: int, seq_length: int = 48,
                          copies: int = 4, seed: int = 7):
    """`prefix.bin/.idx` for `--data-path prefix --tokenizer-type NullTokenizer
    --vocab-size vocab_size --seq-length seq_length` (text ids 0 .. vocab_size - 2,
    EOD = vocab_size - 1, as Megatron-LM's NullTokenizer)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = numpy.random.default_rng(seed)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.int32)
    for _ in range(copies):
        for lengths in ROWS:
            assert sum(lengths) == seq_length, lengths
            tokens = rng.integers(0, vocab_size - 1, size=seq_length, dtype=numpy.int32)
            tokens[numpy.cumsum(lengths) - 1] = vocab_size - 1  # each document ends with EOD
            builder.add_document(tokens, [seq_length])
    builder.finalize(prefix + ".idx")


def document_cases(forward_units):
    """The cases met by the microbatches of one run: `forward_units` is the list
    `dist_runner.py` records (one entry per split forward on the last stage; a
    microbatch's last split carries the document ids of its rows)."""
    edges, rows = {}, {}
    for unit in forward_units:
        key = unit["call"], unit["microbatch"]
        edges.setdefault(key, set()).add((unit["offset"], unit["offset"] + unit["length"]))
        if unit["documents"] is not None:
            rows[key] = unit["documents"]
    met = set()
    for key, documents in rows.items():
        for row in documents:
            met |= _row_cases(numpy.asarray(row), sorted(edges[key]))
    return met


def with_corpus(argv, corpus):
    """`argv` reading the document corpus at `corpus` instead of mock data, where it
    names `DOCUMENT_DATA`; with `corpus` None, on mock data (`DOCUMENT_FLAGS` dropped)."""
    if DOCUMENT_DATA not in argv:
        return argv
    if corpus is None:
        start = argv.index(DOCUMENT_FLAGS[0])
        assert argv[start:start + len(DOCUMENT_FLAGS)] == DOCUMENT_FLAGS, argv
        return argv[:start] + argv[start + len(DOCUMENT_FLAGS):]
    return [corpus if a == DOCUMENT_DATA else a for a in argv if a != "--mock-data"]


def _row_cases(ids, splits):
    met = set()
    if len(splits) > 1 and ids[0] == ids[-1]:
        met.add("spans every split")
    for start, _ in splits[1:]:
        met.add("crosses a split edge" if ids[start - 1] == ids[start] else
                "boundary at a split edge")
    for start, end in splits:
        for doc in numpy.unique(ids[start:end]):
            where = numpy.flatnonzero(ids == doc)
            # a whole document (not cut by the row's start or end) inside this split
            if 0 < where[0] and where[-1] < len(ids) - 1 and start <= where[0] \
                    and where[-1] < end and len(where) < end - start:
                met.add("shorter than its split")
    return met
