"""What a sweep keeps in its folder besides Tune's own files: fedray's record of the sweep, the copy of Tune's tuner
state, and what a resume mends there after a driver was killed hard."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from fedray.errors import ConfigError
from fedray.record.run_dir import atomic_write_bytes

# fedray's own record of a sweep (its MLflow parent run, store, spec). Not named *.json or *.pkl: on a resume Tune
# copies every such file at the sweep folder's top into its staging folder and back at each save, truncating it
# first, so a driver killed then would leave it empty; written once, atomically, and never touched by Tune.
SWEEP_STATE = "fedray_sweep.state"
LEGACY_SWEEP_STATE = "fedray_sweep.json"  # the name sweeps started before had: still resumed
TUNER_FILE, TUNER_COPY = "tuner.pkl", "tuner.pkl.fedray"  # Tune's tuner state, and fedray's copy of it


def state_file(sweep_dir: Path) -> Path:
    """Where a sweep's fedray state is: its own name, or the name sweeps started before had."""
    legacy = sweep_dir / LEGACY_SWEEP_STATE
    return legacy if legacy.is_file() and not (sweep_dir / SWEEP_STATE).exists() else sweep_dir / SWEEP_STATE


def recorded_state(sweep_dir: Path) -> dict[str, Any]:
    """The sweep's fedray state, for a resume; one under the old name is copied to the new one, which Tune leaves
    alone from then on."""
    found = state_file(sweep_dir)
    if not found.is_file():
        raise ConfigError("--resume", f"no sweep to resume at {sweep_dir}; start it without --resume")
    try:
        recorded = json.loads(found.read_text())
    except ValueError:  # only the old name can be cut short (Tune rewrote it; see SWEEP_STATE)
        raise ConfigError("--resume", f"{found} is cut short (its driver was killed while Tune rewrote it), "
                                      "so the sweep's MLflow parent run is unknown; start the sweep again under "
                                      "another --name") from None
    if found.name == LEGACY_SWEEP_STATE:
        atomic_write_bytes(sweep_dir / SWEEP_STATE, found.read_bytes())
    return recorded


def stand_in_for_lost_checkpoints(sweep_dir: Path) -> list[Path]:
    """Make an empty folder for each trial checkpoint the saved sweep state names but that no longer exists.

    A driver killed hard (SIGKILL, a second Ctrl-C) may leave a state naming a checkpoint that the trial's
    newer ones have since replaced (``num_to_keep``); Tune then refuses to restore that trial ("does not exist
    on storage anymore") and fails it. With a stand-in the trial starts, finds no fedray checkpoint in it and
    goes on from its run directory's newest checkpoint, or from scratch (``_trial``), and says so."""
    made = []
    for state_file in sweep_dir.glob("experiment_state-*.json"):
        try:
            trials = json.loads(state_file.read_text())["trial_data"]
        except (OSError, ValueError, KeyError):
            continue
        for trial_json, run_json in trials:
            trial_dir = sweep_dir / json.loads(trial_json)["relative_logdir"]
            for name in set(re.findall(r"checkpoint_\d{6}", run_json)):
                if trial_dir.is_dir() and not (trial_dir / name).exists():
                    (trial_dir / name).mkdir()
                    (trial_dir / name / "GONE.txt").write_text(
                        "Stand-in made by `fedray tune --resume`: the sweep's saved state named this checkpoint,\n"
                        "which no longer existed; the trial went on from its run directory or from scratch.\n")
                    made.append(trial_dir / name)
    return made


def mend_state_files(sweep_dir: Path) -> list[str]:
    """Undo what a driver killed while Tune copied its state into the sweep's folder leaves: Tune copies every state
    file again each time it saves (truncating each first), so a SIGKILL then can leave ``tuner.pkl`` and any
    state file (``experiment_state-*.json``, JSON; the searcher's ``*-state-*``, pickles) empty or cut short, and
    ``Tuner.restore`` fails on them. ``tuner.pkl`` never changes after the sweep starts: it is put back from the copy
    taken then (``TUNER_COPY``); a state file cut short is moved aside (``.broken``), so that Tune resumes from the
    newest whole one. Returns what was mended."""
    import pickle

    import ray.cloudpickle as cloudpickle

    mended = []
    tuner, copy = sweep_dir / TUNER_FILE, sweep_dir / TUNER_COPY
    if tuner.is_file() and copy.is_file() and tuner.read_bytes() != (kept := copy.read_bytes()):
        atomic_write_bytes(tuner, kept)
        mended.append(f"{TUNER_FILE} put back from {TUNER_COPY}")
    for state in sorted(p for p in sweep_dir.glob("*state-*") if p.suffix in (".json", ".pkl")):
        try:
            if state.name.startswith("experiment_state-"):
                json.loads(state.read_text())
            else:  # only a truncated pickle counts: any other failure is not a cut file's, and Tune's to report
                cloudpickle.loads(state.read_bytes())
        except (ValueError, EOFError, pickle.UnpicklingError):
            state.rename(state.with_name(state.name + ".broken"))
            mended.append(f"{state.name} moved aside (cut short)")
    return mended
