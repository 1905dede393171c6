"""`localrt chat`: the Textual terminal chat app (installed as `localrt.tui`).

Importing this package stays cheap and Textual-free; the app lives in `localrt.tui.app`.
"""
