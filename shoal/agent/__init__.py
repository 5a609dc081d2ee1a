"""The agent: the one program Shoal runs inside every sandbox.

Standard library only, because it must start in any runtime environment and
must not put anything of ours on the user's import path. The host talks to it
over the framed channel defined in :mod:`shoal.agent.protocol`.
"""
