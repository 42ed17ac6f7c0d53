"""The `autopar` command line: plan | inspect | run | bench.

    autopar plan gpt --config gpt2-124m --cluster dgx-h100 --nodes 2 -o plan.json
    autopar inspect plan.json
    autopar plan gpt --config tiny4 --cluster cpu --mesh 2x2 --axis-names pp,dp --schedule 1f1b
    autopar run gpt --nproc 4 --mesh 2x2 --axis-names dp,tp --steps 5
    autopar bench gpt --config gpt2-1.5b --cluster dgx-h100 --nodes 1 --csv bench.csv
    autopar plan path/to/model.py:build --cluster dgx-h100 --nodes 8
    autopar run mypackage.models:build --config small --nproc 2 --mesh 2

MODEL is a sample of the source checkout by name (`gpt`, `llama`, `mlp`: `samples/<name>.py`),
`module:factory` or `path/to/file.py:factory`. `factory()` (or `factory(CONFIG)` with
`--config`) returns the model, whose `forward(*batch)` returns the loss; the factory's
module defines `example_batch(model, batch_size)` returning the global batch (a tuple of
tensors) and may list its config names in `CONFIGS` (see `autopar.cli.sources`). `plan` and
`bench` build the model on the meta device; `run` builds it for real on every rank.

Pipelining: name the first mesh axis `pp` or pass `--pipeline-stages N` (which splits the
first axis); `--microbatches` and `--schedule` pin what the search would choose.

Bad input (unknown model, config, preset, strategy, schedule, a malformed mesh) ends with
one line `error: ...` on stderr and exit code 2; a search that fails ends with `error: ...`
and 1.

Modules: `args` (parsing and checks), `sources` (models by name or factory), `commands`
(the typer app), `worker` (the per-rank program `autopar run` launches with torchrun).
"""

from autopar.cli.commands import app, main

__all__ = ["app", "main"]
