"""An MCP server of arithmetic tools (the `mcp` package's `MCPServer`, over stdio): the example of `env.tools`.

    env:
      name: calculator
      tools: ["mcp:stdio:python -m envs.builtin.mcp_arithmetic"]

Tools: `multiply(a, b)` and `divide(a, b)` (integer division; dividing by zero is the tool's error, which the
policy sees as an error observation). `--die-after N` exits the server at its (N+1)-th call, as a crashed tool
server would (the episode then ends as env_error).
"""

from __future__ import annotations

import argparse
import os


def main(argv=None) -> None:
  from mcp.server.mcpserver import MCPServer
  from mcp.server.mcpserver.exceptions import ToolError  # its message reaches the client (others are hidden)
  ap = argparse.ArgumentParser(description=__doc__)
  ap.add_argument("--die-after", type=int, default=None, help="exit at this many calls + 1 (a crash)")
  args = ap.parse_args(argv)
  server = MCPServer("arithmetic", log_level="ERROR")
  calls = [0]

  def count() -> None:
    calls[0] += 1
    if args.die_after is not None and calls[0] > args.die_after:
      os._exit(1)

  @server.tool()
  def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    count()
    return a * b

  @server.tool()
  def divide(a: int, b: int) -> int:
    """Integer division a // b."""
    count()
    if b == 0:
      raise ToolError("division by zero")
    return a // b

  server.run()  # stdio


if __name__ == "__main__":
  main()
