"""`python -m hf2q` is the `hf2q` command; a subcommand whose module is missing names it and how to install
it (exit 1, no traceback) instead of refusing its flags."""
from __future__ import annotations

import subprocess
import sys

# Runs the CLI with `blocked` unimportable: None in sys.modules makes `import name` fail as if it were missing.
_BLOCKED = """
import sys
from hf2q import cli
blocked, argv = sys.argv[1], sys.argv[2:]
for name in [m for m in sys.modules if m == "hf2q.checkpoint.convert" or m.startswith("hf2q.server")]:
    del sys.modules[name]  # imported afresh, so that they meet the blocked module
sys.modules[blocked] = None
sys.exit(cli.main(argv))
"""


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300)


def test_python_m_hf2q_runs_the_cli():
    proc = _run("-m", "hf2q", "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: hf2q ") and "serve" in proc.stdout and "convert" in proc.stdout
    proc = _run("-m", "hf2q", "info")
    assert proc.returncode == 2 and "the following arguments are required: model" in proc.stderr


# Parses each argv as `hf2q` would, then prints which heavy modules that imported.
_PARSE_ONLY = """
import sys
from hf2q import cli
for argv in (["--help"], ["info"], ["generate", "--help"], ["serve", "--help"], ["serve", "--no-such-flag"],
             ["serve", "--port", "99999"], ["bench", "serve", "--help"]):
    try:
        cli.main(argv)
    except SystemExit:
        pass
print(sorted(m for m in ("torch", "transformers", "hf2q.model") if m in sys.modules))
"""


def test_help_and_refused_flags_do_not_import_torch():
    """torch takes seconds to import: only a command that runs needs it, not its help or a mistyped flag."""
    proc = _run("-c", _PARSE_ONLY)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "[]", proc.stdout.splitlines()[-1]


def _assert_names_missing(proc: subprocess.CompletedProcess, command: str, module: str) -> None:
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    assert f"hf2q {command} needs the Python module '{module}'" in proc.stderr
    assert f"pip install {module}" in proc.stderr
    assert "Traceback" not in proc.stderr and "unrecognized arguments" not in proc.stderr


def test_serve_without_uvicorn_names_it():
    """uvicorn is imported when serve runs: the flags parse, then the missing module is named."""
    _assert_names_missing(_run("-c", _BLOCKED, "uvicorn", "serve", "--port", "1"), "serve", "uvicorn")


def test_serve_without_fastapi_names_it():
    _assert_names_missing(_run("-c", _BLOCKED, "fastapi", "serve", "--port", "1", "--max-num-seqs", "2"),
                          "serve", "fastapi")


def test_convert_whose_flags_cannot_load_names_the_module():
    """gguf is imported with convert's flags: the command still takes its flags and names the module."""
    proc = _run("-c", _BLOCKED, "gguf", "convert", "some_dir", "-o", "out.gguf", "--outtype", "f16")
    _assert_names_missing(proc, "convert", "gguf")


def test_unknown_flag_of_an_available_command_is_still_refused():
    proc = _run("-m", "hf2q", "serve", "--no-such-flag")
    assert proc.returncode == 2 and "unrecognized arguments: --no-such-flag" in proc.stderr


def test_every_serve_flag_has_a_description_and_a_default():
    """`hf2q serve --help` explains each flag and its default; testing aids are not listed."""
    import argparse

    from hf2q.server.launch import add_serve_args

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    shown = [a for a in parser._actions if a.help != argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)]
    switches = (argparse._StoreTrueAction, argparse._StoreFalseAction)
    unexplained = [a.option_strings[0] for a in shown
                   if not a.help or (not isinstance(a, switches) and "default" not in a.help)]
    assert not unexplained
    assert "--scripted-replies" not in parser.format_help()
    assert parser.parse_args(["--scripted-replies", "r.json"]).scripted_replies == "r.json"  # still accepted
