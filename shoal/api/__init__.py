"""The HTTP dialects: one router module per dialect, thin: parse, call, render.

Routers call the sessions layer only; how a result looks on the wire is the
dialect's business, decided in its own module.
"""
