"""Messages agree with their counts: "1 GPU", "1 process", "1 micro-batch", never "1 GPUs"."""
from __future__ import annotations

import pytest

from threefold.cli import main
from threefold.config import ConfigError, ParallelConfig
from threefold.configure import load_config
from threefold.words import agree, plural, plural_of


def test_plural_spells_the_noun_the_count_asks_for():
    assert [plural(n, "GPU") for n in (0, 1, 2, 1024)] == ["0 GPUs", "1 GPU", "2 GPUs", "1,024 GPUs"]
    assert plural(1, "process") == "1 process" and plural(4, "process") == "4 processes"
    assert plural(1, "micro-batch") == "1 micro-batch" and plural(3, "micro-batch") == "3 micro-batches"
    assert plural(1, "key/value head") == "1 key/value head" and plural(8, "key/value head") == "8 key/value heads"
    assert plural(2, "entry") == "2 entries" and plural(2, "day") == "2 days" and plural(2, "mesh") == "2 meshes"
    assert plural(2, "index", "indices") == "2 indices" and plural(1, "index", "indices") == "1 index"
    assert agree(1, "rank") == "rank" and agree(3, "rank") == "ranks" and plural_of("GPU") == "GPUs"


@pytest.mark.parametrize("flags, message", [
    (["--pp", "2"], "--pp 2: no layout of this model on 1 GPU takes it"),
    (["--dp-shard", "2"], "--dp-shard 2: no ZeRO layout of this model on 1 GPU has a dp that 2 divides"),
])
def test_a_one_gpu_plan_that_finds_no_layout_says_1_gpu(capsys, flags, message):
    code = main(["plan", "--model", "llama3-8b", "--gpu", "h100-sxm", "--num-gpus", "1", "--global-batch", "64",
                 *flags])
    err = capsys.readouterr().err
    assert code == 2 and err.strip().splitlines()[-1] == f"error: {message}", err


def test_dp_auto_on_one_process_says_1_process():
    cfg = load_config(None, ["parallel.dp=auto", "parallel.tp=2", "train.global_batch=8", "train.micro_batch=2"])
    with pytest.raises(ConfigError, match=r'^parallel.dp: "auto" on 1 process: not divisible by tp×pp×cp = 2×1×1 = 2$'):
        cfg.resolve_world(1)


def test_a_layout_of_two_ranks_in_one_process_says_1_process_is_running():
    from threefold.distributed.mesh import ParallelMesh

    with pytest.raises(ConfigError) as err:
        ParallelMesh.from_config(ParallelConfig(dp=2))
    assert str(err.value) == "parallel: the layout dp×tp×pp×cp = 2×1×1×1 = 2 ranks, but 1 process is running"


def test_one_layer_and_one_key_value_head_are_singular():
    with pytest.raises(ConfigError, match=r"more than the model's 1 layer \(each stage needs a block\)$"):
        load_config(None, ["model.layers=1", "parallel.pp=2"])
    with pytest.raises(ConfigError, match=r"does not divide the 1 key/value head \(model.kv_heads\)"):
        load_config(None, ["model.heads=4", "model.kv_heads=1", "parallel.tp=2"])


def test_one_micro_batch_for_two_pipeline_ranks_warns_in_the_singular(distributed):
    from test_pipeline import run_warning

    warning = distributed.run(2, run_warning, 2, 1)[0]
    assert "parallel.microbatches: 1 micro-batch for 2 pipeline ranks; 1f1b is predicted to idle" in warning
