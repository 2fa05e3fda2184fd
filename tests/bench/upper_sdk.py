"""The benchmark's Python hook on the lattice_hook package: replaces each
tool result's text by its upper case (lattice-sdkbench)."""

import lattice_hook


class Upper:
    def on_tool_result(self, call):
        return call.text.upper()


if __name__ == "__main__":
    lattice_hook.run(Upper())
