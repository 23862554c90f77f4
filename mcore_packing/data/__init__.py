"""Length sources: synthetic distributions and real text that ships with installed packages (no download)."""

from .lengths import DISTRIBUTIONS, sample_lengths
from .real_text import REAL_CORPORA, champ_conversation_texts, real_corpus_lengths, stdlib_source_texts

__all__ = [
    "DISTRIBUTIONS",
    "REAL_CORPORA",
    "champ_conversation_texts",
    "real_corpus_lengths",
    "sample_lengths",
    "stdlib_source_texts",
]
