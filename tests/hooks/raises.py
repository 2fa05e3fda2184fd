"""A hook on the lattice_hook package whose code fails on every tool
result with the result's text in its exception (tests/tests/hook_sdks.rs):
Lattice must abort the query as INTERNAL without the text anywhere."""

import lattice_hook


class Raises:
    def on_tool_result(self, call):
        raise ValueError(f"cannot parse {call.text!r}")


if __name__ == "__main__":
    lattice_hook.run(Raises(), listen="127.0.0.1:0")
