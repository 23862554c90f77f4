"""Where samples come from: the sample type, real text that ships with installed packages (no download),
seeded length distributions, and SFT samples with loss masks. numpy only; never imports torch."""

from .lengths import DISTRIBUTIONS, sample_lengths
from .real_text import REAL_CORPORA, champ_conversation_texts, real_corpus_lengths, stdlib_source_texts
from .sample import SequenceSample

__all__ = [
    "DISTRIBUTIONS",
    "REAL_CORPORA",
    "SequenceSample",
    "champ_conversation_texts",
    "real_corpus_lengths",
    "sample_lengths",
    "stdlib_source_texts",
]
