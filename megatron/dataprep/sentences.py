"""Sentence splitting for `--split-sentences`, with nltk's Punkt and no data download.

Megatron-LM loads the pretrained English Punkt model (`nltk.download("punkt")`). Machines
here have no network, so for `--lang english` (the default) the Punkt algorithm runs with
its default parameters plus a short built-in list of English abbreviations; the split is
then the same on every machine, whatever nltk data happens to be installed. Another
`--lang` loads nltk's trained model for it (punkt_tab data, installed beforehand).
"""

from typing import List

# Punkt stores abbreviations lower-cased, without the final period.
_ABBREVIATIONS = {
    "mr", "mrs", "ms", "dr", "prof", "sr", "jr", "st", "vs", "etc", "e.g", "i.e", "cf",
    "al", "fig", "no", "vol", "approx", "inc", "ltd", "co", "corp", "jan", "feb", "mar",
    "apr", "jun", "jul", "aug", "sep", "sept", "oct", "nov", "dec", "u.s", "u.k",
}


class SentenceSplitter:
    """Split a document into sentences.

    keep_newlines=False: each sentence is its Punkt span; whitespace between sentences is
    dropped (Megatron-LM's default). keep_newlines=True: the whitespace (newlines included)
    after a sentence stays with it, so the sentences concatenate back to the document.
    """

    def __init__(self, keep_newlines: bool = False, lang: str = "english"):
        """``lang`` other than english: nltk's trained Punkt model for it (punkt_tab data,
        which must be installed: LookupError otherwise)."""
        from nltk.tokenize.punkt import PunktParameters, PunktSentenceTokenizer, PunktTokenizer

        if lang == "english":
            params = PunktParameters()
            params.abbrev_types = set(_ABBREVIATIONS)
            self._punkt = PunktSentenceTokenizer(params)
        else:
            self._punkt = PunktTokenizer(lang)
        self.keep_newlines = keep_newlines

    def split(self, text: str) -> List[str]:
        spans = list(self._punkt.span_tokenize(text))
        if not self.keep_newlines:
            return [text[a:b] for a, b in spans]
        if not spans:
            return [text] if text else []
        # Leading whitespace joins the first sentence, trailing whitespace each previous one.
        starts = [0] + [a for a, _ in spans[1:]]
        ends = starts[1:] + [len(text)]
        return [text[a:b] for a, b in zip(starts, ends)]
