"""The per-node checkpoint daemon (``ckptd serve``).

Modules: :mod:`config` (flags and CKPTD_* settings), :mod:`budget` (ByteBudget),
:mod:`segments` (memfd staging segments), :mod:`staging` (sessions and the staging pool),
:mod:`fdsocket` (hands segments to clients), :mod:`pipeline` (write + commit),
:mod:`service` (the gRPC servicer), :mod:`server` (startup, sockets, TLS, drain),
:mod:`metrics`, :mod:`logs`, :mod:`cli`, :mod:`testing` (start a daemon subprocess).
See docs/DAEMON.md.
"""
