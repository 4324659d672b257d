"""``python -m kdray.drafter_corpus build|generate`` (also ``kdray drafter-corpus``)."""
import sys

from kdray.drafter_corpus.cli import main

sys.exit(main())
