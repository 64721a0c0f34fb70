"""labkit: the package behind the course *LLM inference infrastructure, hands-on*.

Each module makes one chapter's idea real and tested; the book and the labs import it.
Chapter 1 (GPU selection, memory, rooflines) lives in :mod:`labkit.hardware`.
"""

__version__ = "0.1.0"
