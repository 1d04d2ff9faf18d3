"""The command line as a user meets it: exit codes, stdout and stderr, no traceback on user errors. Commands run in
this process (tests/cli_run.py says why); the entry point itself runs as a subprocess once here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.cli_run import tpflow, tpflow_process
from tests.test_recipe import BASE


def test_help_and_version():
    out = tpflow_process("--help")  # the real entry point, in a new interpreter
    assert out.returncode == 0
    for command in ("components", "validate", "credit"):
        assert command in out.stdout
    assert tpflow("--version").stdout.startswith("tpflow ")


def test_in_process_runs_report_an_escaped_exception_as_a_traceback(monkeypatch):
    """``tpflow`` (the in-process helper) must not hide a crash that a real process would print."""
    from tpflow import cli as cli_module

    def crash(argv=None):
        raise RuntimeError("boom")

    monkeypatch.setattr(cli_module, "main", crash)
    out = tpflow("validate", "x.toml")
    assert out.returncode == 1 and "Traceback" in out.stderr and "RuntimeError: boom" in out.stderr


def test_components_credit_lists_the_four_assigners():
    out = tpflow("components", "credit")
    assert out.returncode == 0, out.stderr
    for name in ("outcome", "incremental", "turning_point", "consistent"):
        assert name in out.stdout
    assert "balanced: bool = True" in out.stdout and "first_step: bool = True" in out.stdout
    assert "cps" not in out.stdout  # only the kind asked for


def test_components_shows_plugins_and_where_they_come_from(plugin):
    out = tpflow("components")
    assert out.returncode == 0, out.stderr
    assert "brightness" in out.stdout and "plugin tpflow_brightness 0.3.1" in out.stdout
    assert "built-in tpflow/credit/turning_point.py" in out.stdout


COMMANDS = ("train", "validate", "eval", "sample", "inspect-trajectory", "components", "credit", "sweep", "compare",
            "probe", "export", "serve-reward")  # fmt: skip


@pytest.mark.parametrize("columns", ["80", "200"])
def test_every_command_help_fits_the_terminal_without_cutting_a_word(columns):
    """At 80 columns rich's option table left the descriptions ~22 columns and cut longer words with "…"
    (eval --help: eval.images_per_prom…); narrow terminals get click's plain layout, which wraps words whole."""
    for command in COMMANDS:
        out = tpflow(command, "--help", columns=columns)
        assert out.returncode == 0, (command, out.stderr)
        assert "…" not in out.stdout, (command, out.stdout)
        assert max(len(line) for line in out.stdout.splitlines()) <= int(columns), command
    if columns == "200":  # rich reads [section] in a help text as markup and drops it (probe --arm lost three)
        for command in COMMANDS:
            plain = " ".join(tpflow(command, "--help", columns="80").stdout.split())
            rich = " ".join(tpflow(command, "--help", columns="200").stdout.replace("│", " ").split())
            for bracketed in set(re.findall(r"\[[a-z_.]+\]", plain)):
                assert bracketed in rich, (command, bracketed)
    text = " ".join(tpflow("eval", "--help", columns="80").stdout.split())
    assert "eval.images_per_prompt; GenEval: 4" in text and "RUN/eval/step<S>_<prompts>_T<steps>" in text
    assert "Usage: tpflow" in tpflow("--help", columns="80").stdout  # the command list: rich, at any width


def test_components_at_80_columns_is_a_list_and_one_component_has_a_view_of_its_own():
    narrow = tpflow("components", columns="80")
    assert narrow.returncode == 0, narrow.stderr
    lines = narrow.stdout.splitlines()
    assert "┃" not in narrow.stdout and max(len(line) for line in lines) <= 80  # not a table of 4-word columns
    assert all(line == line.rstrip() for line in lines)  # no padding after the text (pipes, grep, diffs)
    wide = tpflow("components", columns="200").stdout.splitlines()
    assert any("┃" in line for line in wide)  # a wide terminal keeps the table
    for name in ("credit consistent", "plan window-schedule", "sampler cps", "optimizer grpo"):
        assert name in narrow.stdout  # every component's header line: kind and name
    assert "tpflow components KIND NAME" in narrow.stdout
    one = tpflow("components", "credit", "consistent", columns="80")
    assert one.returncode == 0, one.stderr
    flat = " ".join(one.stdout.split())
    assert flat.startswith("credit consistent (built-in tpflow/credit/consistent.py")
    assert "balanced: bool = True" in flat and "first_step: bool = True" in flat
    assert "outcome" not in one.stdout.split("(built-in")[0]  # that component only
    bad = tpflow("components", "credit", "consistant")
    assert bad.returncode == 2 and "Did you mean 'consistent'?" in bad.stderr and "Traceback" not in bad.stderr


def test_the_run_header_breaks_between_values_never_inside_one():
    from tpflow.train.run_logger import fit_segments

    segments = ["tpflow train recipes/shapes_tp.toml -> runs/shapes_tp", "epochs 0..19", "credit consistent",
                "32 trainable tensors", "device cpu (backbone device = 'cpu')"]  # fmt: skip
    text = fit_segments(segments, 80)
    lines = text.splitlines()
    assert lines == [  # greedy: each line takes the next value while it fits
        "tpflow train recipes/shapes_tp.toml -> runs/shapes_tp | epochs 0..19",
        "  credit consistent | 32 trainable tensors",
        "  device cpu (backbone device = 'cpu')",
    ]
    for segment in segments:
        assert segment in text  # whole, on one line
    assert fit_segments(segments, 1000) == " | ".join(segments)
    assert fit_segments(["x" * 90, "a"], 80).splitlines() == ["x" * 90, "  a"]  # too long alone: a line of its own


def test_components_unknown_kind_exits_2():
    out = tpflow("components", "rewards")
    assert out.returncode == 2 and "Kinds are" in out.stderr and "Traceback" not in out.stderr


def test_validate_ok(plugin, tmp_path):
    (tmp_path / "r.toml").write_text(BASE)
    (tmp_path / "prompts.txt").write_text("a photo of a cat\n")  # the machine checks read the prompts
    out = tpflow("validate", str(tmp_path / "r.toml"), "--set", "optimizer.learning_rate=2e-4", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "valid" in out.stdout and "learning_rate = 0.0002" in out.stdout


def test_validate_checks_a_multi_process_layout_without_a_gpu():
    """The paper's 8 x 4 layout could only be checked by `train`, which stops first at the missing GPU."""
    root = Path(__file__).resolve().parent.parent
    ok = tpflow("validate", "recipes/geneval_tp.toml", "--no-machine", "--num-processes", "8", "--num-machines", "4",
                cwd=root)  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    flat = " ".join(ok.stdout.split())
    assert "layout: 32 processes: each samples 4 of the epoch's 128 rollout batches" in flat  # 48 x 24 / 9
    bad = tpflow("validate", "recipes/geneval_tp.toml", "--no-machine", "--num-processes", "7", cwd=root)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    flat = " ".join(bad.stderr.split())
    assert "7 processes cannot share the epoch equally" in flat and "[1, 2, 4, 8, 16, 32, 64, 128]" in flat
    assert "valid" not in bad.stdout  # refused before the table
    single = tpflow("validate", "recipes/geneval_tp.toml", "--no-machine", cwd=root)
    assert single.returncode == 0 and "layout:" not in single.stdout


def test_recipes_reading_pickscore_prompts_say_where_they_come_from():
    root = Path(__file__).resolve().parent.parent
    doc = (root / "docs" / "rewards.md").read_text()
    assert "### Prompt files of the paper recipes" in doc and "dataset/pickscore_sfw/train.txt" in doc
    readers = [p for p in sorted((root / "recipes").rglob("*.toml")) if "data/pickscore/" in p.read_text()]
    assert len(readers) >= 9
    for path in readers:
        assert "docs/rewards.md" in path.read_text(), path.name


def test_validate_misspelt_option_exits_2_with_one_paragraph(plugin, tmp_path):
    (tmp_path / "r.toml").write_text(BASE.replace("balanced = false", "balanse = false"))
    out = tpflow("validate", str(tmp_path / "r.toml"))
    assert out.returncode == 2
    assert "Traceback" not in out.stderr + out.stdout
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, out.stderr
    assert "[credit] (turning_point)" in lines[0] and "'balanse'" in lines[0]
    assert "Allowed options: balanced, first_step" in lines[0]


def test_validate_unknown_component_exits_2_listing_names(plugin, tmp_path):
    (tmp_path / "r.toml").write_text(BASE.replace('name = "grpo"', 'name = "ppo"'))
    out = tpflow("validate", str(tmp_path / "r.toml"))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "[optimizer]" in out.stderr and "'ppo' is not a registered optimizer" in out.stderr
    assert "Available: awm, dgpo, grpo" in out.stderr


def test_validate_bad_override_and_missing_file(tmp_path):
    out = tpflow("validate", str(tmp_path / "missing.toml"))
    assert out.returncode == 2 and "Recipe file not found" in out.stderr and "Traceback" not in out.stderr
    (tmp_path / "r.toml").write_text(BASE)
    out = tpflow("validate", str(tmp_path / "r.toml"), "--set", "nodot=1")
    assert out.returncode == 2 and "section.key=value" in out.stderr


def test_credit_command_shows_worked_example_1():
    out = tpflow("credit", "50,46,40,47,52,55", "-a", "consistent", "-a", "outcome")
    assert out.returncode == 0, out.stderr
    assert "-4 -6 15* 5 3" in out.stdout  # docs/algorithm.md §9 Example 1, published row
    assert "55 55 55 55 55" in out.stdout
    bad = tpflow("credit", "1,2,x")
    assert bad.returncode == 2 and "comma-separated" in bad.stderr


def test_validate_checks_component_limits_across_sections(plugin, tmp_path):
    """A limit one component puts on another section (cps: [rollout] noise_level in [0, 1]) fails validate, before
    any weights load; it once failed only at the first sampling step."""
    (tmp_path / "r.toml").write_text(BASE)
    out = tpflow("validate", str(tmp_path / "r.toml"), "--set", "sampler.name=cps", "--set", "rollout.noise_level=1.5")
    assert out.returncode == 2 and "Traceback" not in out.stderr + out.stdout
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "noise_level = 1.5" in lines[0] and "cps" in lines[0] and "[0, 1]" in lines[0]
    ok = tpflow(
        "validate",
        str(tmp_path / "r.toml"),
        "--set",
        "sampler.name=flow-sde",
        "--set",
        "rollout.noise_level=1.5",
        "--no-machine",
    )
    assert ok.returncode == 0, ok.stderr


def test_every_train_option_reaches_the_launched_processes(plugin, tmp_path, monkeypatch):
    """``tpflow train --num-processes N`` runs each process with the same command minus the launcher's options, built
    from the command's own parameter list: an option added to ``train`` later needs no second edit to reach them."""
    import typer.main

    import tpflow.launch
    from tpflow.cli import app, main

    (tmp_path / "r.toml").write_text(BASE)
    (tmp_path / "prompts.txt").write_text("a photo of a cat\n")  # checked before the processes start
    monkeypatch.chdir(tmp_path)  # the prompts and the run dir RUN are relative
    captured: list[list[str]] = []
    monkeypatch.setattr(tpflow.launch, "launch", lambda args: captured.append(args) or 0)
    command = typer.main.get_command(app).commands["train"]
    values = {"set_": ["optimizer.learning_rate=2e-4", "train.seed=3"], "resume": "@latest", "run_dir": "RUN"}
    argv = ["train", str(tmp_path / "r.toml"), "--num-processes", "2"]
    forwarded = []
    for param in command.params:
        if param.name in tpflow.launch.LAUNCHER_OPTIONS or not param.opts[0].startswith("--"):
            continue
        value = values.get(param.name, "2")  # every other option is a number today; a new one shows up here
        for v in value if isinstance(value, list) else [value]:
            argv += [param.opts[0], v]
            forwarded += [param.opts[0], v]
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 0 and len(captured) == 1
    child = captured[0][captured[0].index("tpflow.cli") + 1 :]
    assert child[:2] == ["train", str(tmp_path / "r.toml")]
    assert "--num-processes" not in child and "--num-machines" not in child
    pairs = list(zip(forwarded[::2], forwarded[1::2], strict=True))
    assert pairs == list(zip(child[2::2], child[3::2], strict=True)), (forwarded, child)


def run_here(*args: str) -> tuple[int, str, str]:
    """``tpflow ARGS`` at the terminal width the test set: (exit status, stdout, stderr)."""
    done = tpflow(*args, columns=None)
    return done.returncode, done.stdout, done.stderr


K10 = ("0.5,0.75,0.25,0.75,0.25,0,0,0,0,0", "0,0.25,0.75,0,0.5,1,0,1,0,0")  # K = 10, as the shipped recipes


@pytest.mark.parametrize("columns", ["80", "60"])
def test_credit_table_wraps_and_never_cuts_at_80_columns(monkeypatch, columns):
    """At 80 columns the K = 10 table once dropped a column and cut rewards short with '…'."""
    monkeypatch.setenv("COLUMNS", columns)
    code, out, err = run_here("credit", *K10)
    assert code == 0, err
    assert "…" not in out
    assert max(len(line) for line in out.splitlines()) <= int(columns)
    for name in ("consistent", "incremental", "outcome", "turning_point"):
        assert name in out
    numbers = [word for line in out.splitlines() if "│" in line for word in line.split("│")[-2].split()]
    assert numbers.count("-0.75*") == 4  # traj 0's two turning points, in consistent and in turning_point
    if columns == "80":  # one line per trace at 80 columns
        assert "0.5 0.75 0.25 0.75 0.25 0 0 0 0 0" in out
        assert "0.25 -0.75* 0.5 -0.75* -0.25 0 0 0 0" in out


def test_credit_accepts_negative_rewards_and_refuses_non_finite_ones():
    code, out, err = run_here("credit", "-1,2,-3", "-0.5,1,-2", "-a", "outcome")
    assert code == 0, err
    assert "-1 2 -3" in out and "-3 -3" in out and "-2 -2" in out
    for bad in ("1,nan,3", "1,inf,3", "-inf,0,1"):
        code, out, err = run_here("credit", bad)
        assert code == 2 and "finite" in err and bad in err and "Traceback" not in err, err
    code, _, err = run_here("credit", "1,2", "--balancd")
    assert code == 2 and "'--balancd' is not an option" in err


def test_a_check_across_options_does_not_print_the_whole_options_dict():
    recipe = str(Path(__file__).resolve().parent.parent / "recipes" / "shapes_tp.toml")
    code, _, err = run_here("validate", recipe, "--set", "rollout.window_size=12", "--no-machine")
    assert code == 2
    assert "window_size=12 exceeds num_steps=10" in err
    assert "{" not in err and "noise_level" not in err and "Value error" not in err, err


def test_a_missing_relative_prompt_file_says_where_it_was_looked_for(plugin, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "r.toml").write_text(BASE.replace('path = "prompts.txt"', 'path = "data/pickscore/train.txt"'))
    code, _, err = run_here("validate", "r.toml")
    assert code == 2 and "Traceback" not in err
    assert "relative path is read from the working directory" in err
    assert str(tmp_path / "data" / "pickscore" / "train.txt") in err and "header comment" in err


def test_export_refuses_a_folder_that_holds_files(tmp_path):
    """Before any checkpoint is read: an --out with files in it is kept unless --overwrite."""
    out = tmp_path / "exports"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    code, _, err = run_here("export", str(tmp_path / "no-run"), "--out", str(out))
    assert code == 2 and "already exists and is not empty" in err and "--overwrite" in err, err
    assert (out / "notes.txt").read_text() == "mine"
    code, _, err = run_here("export", str(tmp_path / "no-run"), "--out", str(out), "--overwrite")
    assert code == 2 and "No valid checkpoint" in err  # past the check, to the missing checkpoint


def test_components_show_allowed_values_limits_and_descriptions(monkeypatch):
    """`score: Literal = 'partial'` once hid the choices, no option had its description, and weighted's parts were
    `rewards: list = required` only."""
    monkeypatch.setenv("COLUMNS", "200")
    code, out, err = run_here("components", "reward")
    assert code == 0, err
    text = _column(out, 3)
    assert "score: 'partial' | 'strict' | 'soft' = 'partial'" in text
    assert "Training reward: the partial-credit GenEval score" in text  # shapes-geneval's description
    assert "scale: float = 2.5 (> 0)" in text  # clipscore's limit
    assert "rewards: list[WeightedPart] = required (at least 1 item)" in text
    assert "weight: float = 1.0 Multiplies this reward's scores in the sum." in text  # a part's own options
    code, out, err = run_here("components", "backbone")
    assert code == 0, err
    assert "dtype: 'fp32' | 'fp16' | 'bf16' = 'bf16'" in _column(out, 3)


def _column(table: str, index: int) -> str:
    """The words of one column of a printed rich table, its wrapped lines joined."""
    return " ".join(word for line in table.splitlines() if "│" in line for word in line.split("│")[index].split())
