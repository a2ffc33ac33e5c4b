"""tests/cli_runs.py: several scripts' command lines, each with its own exit status
and output, as `python SCRIPT ARGS` would give them."""

from tests.cli_runs import run_command_lines


def test_each_run_has_its_own_status_and_output(tmp_path):
    script = tmp_path / "tool.py"
    script.write_text("import sys\n"
                      "if __name__ == '__main__':\n"
                      "    print('args', sys.argv[1:])\n"
                      "    mode = sys.argv[1]\n"
                      "    if mode == 'two':\n"
                      "        print('error: bad', file=sys.stderr); sys.exit(2)\n"
                      "    if mode == 'message':\n"
                      "        sys.exit('stopped')\n"
                      "    if mode == 'raise':\n"
                      "        raise ValueError('boom')\n")
    runs = run_command_lines([(str(script), [m]) for m in ("ok", "two", "message", "raise", "ok")], timeout=120)
    assert runs[0] == (0, "args ['ok']\n", "") and runs[4] == runs[0]
    assert runs[1] == (2, "args ['two']\n", "error: bad\n")
    assert runs[2][0] == 1 and runs[2][2] == "stopped\n"  # sys.exit(message): the message on stderr, status 1
    assert runs[3][0] == 1 and "ValueError: boom" in runs[3][2] and "Traceback" in runs[3][2]
