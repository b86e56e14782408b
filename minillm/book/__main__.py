"""`python -m minillm.book {notebooks,contents}`: the written chapters' notebooks, or the README's contents table."""

import sys

from minillm.book import load_book, notebooks, readme_contents

COMMANDS = {"notebooks": lambda book: "\n".join(notebooks(book)), "contents": readme_contents}

if len(sys.argv) != 2 or sys.argv[1] not in COMMANDS:
    sys.exit(f"usage: python -m minillm.book {{{','.join(COMMANDS)}}}")
print(COMMANDS[sys.argv[1]](load_book()))
