"""`python -m localrt.tui [NAME]`: the chat app without going through the `localrt` CLI."""

from localrt.chat_command import main

raise SystemExit(main())
