"""`localrt ...`: the command line, a client of a running `localrt serve` or of the same server app in process.

`main.py` builds the parser from one `add_*` function per command (in the module of its group) and
turns every user mistake into one line on stderr. The console script is `localrt.cli:main`.
"""

from localrt.cli.main import build_parser
from localrt.cli.main import main

__all__ = ["build_parser", "main"]
