"""The science record's studies: one folder ``results/<folder>/`` per learning claim, holding its README (the
question, the protocol, one table, one plot, the reading, the command that regenerates them) and its records,
compressed (``records.tar.xz``: each benchmark output's finished runs, ``benchmarks/run_records.py``).
docs/benchmarks.md indexes them, one line a claim.

Registering a study (results/README.md has the steps) is one ``Study`` in ``STUDIES``: its folder, the protocol
section it was declared in, the benchmark outputs whose runs it keeps, each with the command that trained them (the
report rebuilds the declared runs from it: ``benchmarks/study_report.py``), and the keys of the generated sections
its README holds. A benchmark output or a section key no study names gets a folder of its own, named after the
output (``folder_of_output``), so that nothing a benchmark writes is lost.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

RESULTS = "results"  # the studies' folders, at the repository's top level
# where records lived before their study had a folder (git history: a study's first record may be there)
FORMER_RECORDS = ("results", "benchmarks/records")
README = "README.md"
ARCHIVE = "records.tar.xz"  # a study's records: its outputs' finished runs, one top-level folder per output
# the same records as a gzip tar, as written until xz replaced it: read too where one is beside ARCHIVE (or alone:
# saved by an older checkout), removed when ARCHIVE is written
LEGACY_ARCHIVE = "records.tar.gz"


@dataclass(frozen=True)
class Protocol:
    """Where a study was declared: a file and the start of its section's heading (the section runs to the next
    heading of the same or a higher level)."""

    path: str
    title: str


@dataclass(frozen=True)
class Output:
    """A benchmark output a study keeps (``outputs/<name>``) and the command that trained its runs: a benchmark
    script and its options (--resume and --report aside)."""

    name: str
    command: tuple[str, ...]
    copied: tuple[str, ...] = ()  # run folders another study's command trained, copied in for a contrast


@dataclass(frozen=True)
class Study:
    folder: str
    title: str
    protocol: Protocol | None = None
    outputs: tuple[Output, ...] = ()
    sections: tuple[str, ...] = ()  # the generated sections (their keys) that the study's README holds


BRANCHING = "benchmarks/bench_branching.py"
BRANCHING_PROTOCOL = "docs/protocol_branching.md"
LEAD = ("--lead", "--top-p", "1.0", "--warmup-steps", "0", "--token-budget", "200000", "--iterations", "150",
        "--eval-every", "1", "--curve-questions", "50", "--eval-questions", "200")  # the sixth to ninth designs'
PILOT_ARMS = ("--seeds", "0", "--settings", "tree (2,2,1) uniform", "chain at equal tokens", "--chain-group-size", "5")
FOURTH_DESIGN = ("--start-misroute", "0.85", "--start-misroute-role", "chair", "--token-budget", "200000",
                 "--chain-group-size", "5", "--iterations", "150", "--eval-every", "2", "--eval-questions", "300",
                 "--seeds", "0", "1", "2", "3", "4", "--settings", "tree (2,2,1) uniform")
NINTH_START = ("--start-goal", "--start-misroute", "0.98", "--start-misroute-role", "chair", "--lr", "5e-5")
NINTH_DESIGN = "bench_branching_lead_start_goal_start_misroute_0.98_chair_top_p_1_lr_5e_05_warmup_steps_0"
# the variants of the HotpotQA tree are read against its runs from the same start, copied in from the study before
COPIED_TREE = ("tree_s0", "tree_s1", "tree_s2")

STUDIES: tuple[Study, ...] = (
    Study("learning_synthhop", "Tree vs chain and the advantage ablation on SynthHop-v0 (issues 6, 15)",
          sections=("learning",)),
    Study("demo", "The CPU demo learns, across warm-start seeds (issues 15, 46)",
          Protocol("docs/protocol_demo.md", "Protocol 7: the second stage exact")),
    Study("ppo_minibatches", "PPO mini-batches: learning per rollout (issue 14)", sections=("update",)),
    Study("branching_equal_tokens", "Tree vs chain at equal generated tokens on SynthBranch-v0: the fifth design "
          "(issue 27)", Protocol(BRANCHING_PROTOCOL, "The fifth design: a constant learning rate"),
          sections=("branching-start-misroute-0.85-chair-lr-2e-05-warmup-steps-0",)),
    Study("saturation_guard", "The saturation guard against late collapse (issue 47)",
          Protocol(BRANCHING_PROTOCOL, "The saturation guard on the fourth design's collapsing seed"),
          (Output("bench_branching_start_misroute_0.85_chair", (BRANCHING, *FOURTH_DESIGN)),
           Output("bench_branching_start_misroute_0.85_chair_stop_after_uniform_3",
                  (BRANCHING, *FOURTH_DESIGN, "--stop-after-uniform", "3"))),
          ("saturation-guard", "branching-start-misroute-0.85-chair-stop-after-uniform-3")),
    Study("branching_rare_route", "A rare decision mid-trajectory: the sixth to ninth designs (issue 47)",
          Protocol(BRANCHING_PROTOCOL, "The ninth design's pilot at lr 5e-5"),
          (Output(NINTH_DESIGN, (BRANCHING, *LEAD, *NINTH_START, "--chain-group-size", "4",
                                 "--seeds", "0", "1", "2", "3", "4", "5")),
           Output(f"{NINTH_DESIGN}_pilot_chain_g5",
                  (BRANCHING, *LEAD, *NINTH_START, "--chain-group-size", "5", "--seeds", "0", "--settings",
                   "chain at equal tokens", "--output", f"outputs/{NINTH_DESIGN}_pilot_chain_g5")),
           Output("bench_branching_lead_start_misroute_0.98_chair_top_p_1_lr_5e_05_warmup_steps_0",
                  (BRANCHING, *LEAD, "--start-misroute", "0.98", "--start-misroute-role", "chair", "--lr", "5e-5",
                   *PILOT_ARMS)),
           Output("bench_branching_lead_start_misroute_0.98_chair_top_p_1_lr_0.0001_warmup_steps_0",
                  (BRANCHING, *LEAD, "--start-misroute", "0.98", "--start-misroute-role", "chair", "--lr", "1e-4",
                   *PILOT_ARMS)),
           Output("bench_branching_lead_start_misroute_0.95_chair_top_p_1_lr_0.0001_warmup_steps_0",
                  (BRANCHING, *LEAD, "--start-misroute", "0.95", "--start-misroute-role", "chair", "--lr", "1e-4",
                   *PILOT_ARMS)),
           Output("bench_branching_lead_start_misroute_0.95_chair_top_p_1_warmup_steps_0",
                  (BRANCHING, *LEAD, "--start-misroute", "0.95", "--start-misroute-role", "chair", "--lr", "2e-4",
                   *PILOT_ARMS))),
          ("branching-lead-start-goal-start-misroute-0.98-chair-top-p-1-lr-5e-05-warmup-steps-0",)),
    Study("pipelining", "Pipelined rollouts learn as well as the synchronous loop (issue 65)",
          Protocol("docs/protocol_pipelining.md", "Protocol: does one-step off-policy pipelining"),
          (Output("pipelining", ("benchmarks/pipelining_learning.py", "--seeds", "0", "1", "2", "3", "4")),),
          ("pipelining-learning",)),
    Study("budget_table", "The paper's budget table at small scale: tree against chain at equal full-chain budget, "
          "prompts and iterations (issue 64)", Protocol(BRANCHING_PROTOCOL, "The budget table"),
          (Output("budget_table", ("benchmarks/bench_budget.py",)),), ("budget-table",)),
    Study("decision_test", "The decision test: at budget 2, a tree that re-draws the decision against chains on "
          "SynthBranch-v0 (issue 72)", Protocol("docs/protocol_decision.md", "The decision test"),
          (Output("decision_test", ("benchmarks/bench_decision.py",)),), ("decision-test", "decision-probe")),
    Study("hotpotqa_cpu", "Real questions on a CPU: SmolLM2-135M on HotpotQA from its warm start, tree against chain "
          "at budget 2 (issue 70)", Protocol("docs/protocol_hotpotqa.md", "Protocol: real questions on a CPU"),
          (Output("hotpotqa_cpu", ("benchmarks/bench_hotpotqa.py", "--arms", "tree", "chain", "tree_entropy",
                                   "--seeds", "0", "1", "2")),)),
    Study("hotpotqa_cpu_f3", "Real questions from the format-3 start: the mission's command on a CPU from the start it "
          "now takes (issue 70)",
          Protocol("docs/protocol_hotpotqa_f3.md", "Protocol: real questions from the format-3"),
          (Output("hotpotqa_cpu_f3", ("benchmarks/bench_hotpotqa.py", "--arms", "tree", "--seeds", "0", "1", "2",
                                      "--output", "outputs/hotpotqa_cpu_f3")),)),
    Study("hotpotqa_cpu_f3_40", "The format-3 runs trained on to 40 iterations: the gain's 60-minute bound (issue 70)",
          Protocol("docs/protocol_hotpotqa_f3_40.md", "Protocol: the format-3 runs read again at 40"),
          (Output("hotpotqa_cpu_f3_40", ("benchmarks/bench_hotpotqa.py", "--arms", "tree", "--seeds", "0", "1", "2",
                                         "--iterations", "40", "--output", "outputs/hotpotqa_cpu_f3_40")),)),
    Study("hotpotqa_cpu_em", "The format-3 start trained on exact match alone (issue 70; stopped after seed 0)",
          Protocol("docs/protocol_hotpotqa_em.md", "Protocol: the format-3 start trained on exact match"),
          (Output("hotpotqa_cpu_em", ("benchmarks/bench_hotpotqa.py", "--arms", "tree_em", "--seeds", "0",
                                      "--output", "outputs/hotpotqa_cpu_em"), COPIED_TREE),)),
    Study("hotpotqa_cpu_f1", "The format-3 start trained on token F1 (issue 70)",
          Protocol("docs/protocol_hotpotqa_f1.md", "Protocol: the format-3 start trained on token F1"),
          (Output("hotpotqa_cpu_f1", ("benchmarks/bench_hotpotqa.py", "--arms", "tree_f1", "--seeds", "0", "1",
                                      "2", "--output", "outputs/hotpotqa_cpu_f1"), COPIED_TREE),)),
    Study("hotpotqa_cpu_temp", "The format-3 start sampled at temperature 0.7 (issue 70)",
          Protocol("docs/protocol_hotpotqa_temperature.md",
                   "Protocol: the format-3 start sampled at a lower temperature"),
          (Output("hotpotqa_cpu_temp", ("benchmarks/bench_hotpotqa.py", "--arms", "tree_t07", "--seeds", "0", "1",
                                        "2", "--output", "outputs/hotpotqa_cpu_temp"), COPIED_TREE),)),
    Study("hotpotqa_cpu_start_lr", "The HotpotQA start's fine-tuning: lr 1e-3, then every train question (issue 70)",
          Protocol("docs/protocol_hotpotqa_start.md", "Protocol: the HotpotQA start at a higher learning rate")),
    Study("hotpotqa_cpu_all", "Real questions from the adopted start (issue 70)",
          Protocol("docs/protocol_hotpotqa_all.md", "Protocol: real questions from the adopted start"),
          (Output("hotpotqa_cpu_all", ("benchmarks/bench_hotpotqa.py", "--arms", "tree", "--seeds", "0", "1", "2",
                                       "--output", "outputs/hotpotqa_cpu_all")),)),
    Study("hotpotqa_cpu_lr", "The RL learning rate on real questions (issue 70)",
          Protocol("docs/protocol_hotpotqa_lr.md", "Protocol: the RL learning rate on real questions"),
          (Output("hotpotqa_cpu_lr", ("benchmarks/bench_hotpotqa.py", "--arms", "tree_lr5e-4", "--seeds", "0", "1",
                                      "2", "--output", "outputs/hotpotqa_cpu_lr"), COPIED_TREE),)),
    Study("hotpotqa_cpu_replay", "The HotpotQA start with its frozen bottom replayed, and the gain from it (issue 70)",
          Protocol("docs/protocol_hotpotqa_replay.md", "Protocol: the HotpotQA start with its frozen bottom replayed"),
          (Output("hotpotqa_cpu_replay", ("benchmarks/bench_hotpotqa.py", "--arms", "tree", "--seeds", "0", "1", "2",
                                          "--output", "outputs/hotpotqa_cpu_replay"),
                  ("tree_lr5e-4_s0", "tree_lr5e-4_s1", "tree_lr5e-4_s2")),)),
)


def study(folder: str) -> Study:
    """The registered study of ``folder``; a ``KeyError`` naming the registered ones."""
    for entry in STUDIES:
        if entry.folder == folder:
            return entry
    raise KeyError(f"no study {folder!r} in benchmarks/studies.py (registered: "
                   f"{', '.join(entry.folder for entry in STUDIES)}; results/README.md says how to add one)")


def folder_of_output(name: str) -> str:
    """The study folder that keeps benchmark output ``name``'s records: its registered study's, else ``name``."""
    return next((entry.folder for entry in STUDIES if name in {output.name for output in entry.outputs}), name)


def section_file(key: str, output: str | Path) -> Path:
    """Where the generated section ``key`` of a learning study goes (relative to the repository's root, as the
    benchmarks run from it): the README of the study that registers the key, else of the folder that keeps
    ``output``'s records."""
    folder = next((entry.folder for entry in STUDIES if key in entry.sections), None)
    return Path(RESULTS) / (folder or folder_of_output(Path(output).name)) / README
