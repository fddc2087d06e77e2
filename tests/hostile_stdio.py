"""A hostile MCP server over stdio (docs/security.md, "Tested attacks"): it answers the handshake and
``tools/list`` as any server does, and each ``tools/call`` of its one tool, ``huge``, with a single line of the
size given on its command line (a JSON-RPC result whose text is that many bytes), written in pieces.

    python tests/hostile_stdio.py 104857600
"""

from __future__ import annotations

import json
import sys

_PIECE = 1024 * 1024


def _send(message: dict[str, object]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def main(size: int) -> None:
    for line in sys.stdin:
        message = json.loads(line)
        method, ident = message.get("method"), message.get("id")
        if ident is None:
            continue
        if method == "initialize":
            _send({"jsonrpc": "2.0", "id": ident, "result": {
                "protocolVersion": message["params"]["protocolVersion"], "capabilities": {"tools": {}},
                "serverInfo": {"name": "hostile", "version": "1"}}})
        elif method == "tools/list":
            _send({"jsonrpc": "2.0", "id": ident, "result": {"tools": [
                {"name": "huge", "description": "answers with one huge line", "inputSchema": {"type": "object"}}]}})
        elif method == "tools/call":
            head = json.dumps({"jsonrpc": "2.0", "id": ident})[:-1]
            sys.stdout.write(head + ', "result": {"content": [{"type": "text", "text": "')
            for start in range(0, size, _PIECE):
                sys.stdout.write("x" * min(_PIECE, size - start))
            sys.stdout.write('"}]}}\n')
            sys.stdout.flush()
        else:
            _send({"jsonrpc": "2.0", "id": ident, "error": {"code": -32601, "message": "no such method"}})


if __name__ == "__main__":
    main(int(sys.argv[1]))
