"""The channel: what happens to a message on the wire, for every message between clients and server, both ways,
for every method (docs/channel.md). An ordered list of stages (:mod:`.stages`: the wire format
``channel.precision`` today; compression, privacy's clip and noise and an adversary's forgery join them in a fixed
order), each with a client side, run where the client runs, and a server side. ``comm/bytes_*`` and the simulated
clock count the bytes the channel says were sent. Knows no method: it reads a message's field declarations
(:mod:`.message`).

The package's modules are imported by name (``fedray.channel.channel``, ``.stages``, ``.message``, ``.config``):
``fedray.config`` reads ``.config`` while the others read the config, so this file imports nothing.
"""
