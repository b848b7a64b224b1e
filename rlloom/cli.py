"""The `rlloom` command: `train`, `sft`, `eval`, `export`, `plan`, `config show`, `config doc`, `plot`,
`init-model` and `compare-layers`.

rlloom train RECIPE_OR_YAML [section.key=value ...]
rlloom sft RECIPE_OR_YAML [section.key=value ...]
rlloom eval MODEL_OR_RUN DATA [section.key=value ...] [--samples N] [--temperature T] [--responses FILE]
rlloom export RUN_DIR_OR_CHECKPOINT OUT [--dtype auto|float32|bfloat16|float16]
rlloom config show RECIPE_OR_YAML [section.key=value ...]
rlloom config doc
rlloom plot RUN_DIR
rlloom init-model tiny-dense|tiny-moe|tiny-mla|tiny-vl|tiny-vl3 DIR [--layers N] [--hidden H]
rlloom compare-layers MODEL --prompt TEXT [--max-new-tokens N] [--seed S] [--device cpu|cuda] [--dtype D] [--exact]
rlloom plan MODEL --gpus N --gpu-memory-gb G [--critic] [--teacher T] [--reward-model R] [--check tp=..,pp=..,cp=..,ep=..,offload=F] [--json]

A user error (`UserError`: config, data file, model path, start-up checks) prints one line,
`rlloom: error: ...`, and exits 2; internal bugs keep their traceback. Ctrl-C or SIGTERM during a
run's steps finishes the step, writes a checkpoint and exits 128 + the signal's number with one line
saying where to continue (trainer/stop.py); Ctrl-C elsewhere, or a second one, prints one line too.
`train` and `sft` go on when their stdout or stderr is a pipe whose reader is gone (`| tee` ended by the same
Ctrl-C; observability/pipes.py); the other commands stop quietly there, as `cat` does.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import NoReturn

from rlloom.cluster import WorkerFailure
from rlloom.config import UserError
from rlloom.engines.train.sealed import CheckpointError
from rlloom.models.tiny import TINY_KINDS

_OVERRIDES_HELP = "dotted overrides such as algorithm.eps_high=0.28 trainer.total_steps=50"


def _parser() -> argparse.ArgumentParser:
    from rlloom.config.loading import recipe_names

    recipes = ", ".join(recipe_names())
    parser = argparse.ArgumentParser(prog="rlloom", description="RL post-training of LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser(
        "train", help="run RL training", description=f"Run RL training. Recipes: {recipes}."
    )
    train.add_argument("config", help="recipe name or YAML file")
    train.add_argument("overrides", nargs="*", default=[], help=_OVERRIDES_HELP)
    sft = sub.add_parser(
        "sft",
        help="run supervised fine-tuning",
        description="Supervised fine-tuning on chat conversations (data.task=jsonl or parquet, the messages "
        "under data.messages_key; or the arithmetic task's answers): the NLL of the assistant tokens, on RL's "
        f"training engine, checkpoints and layouts. Recipes: {recipes}.",
    )
    sft.add_argument("config", help="recipe name or YAML file")
    sft.add_argument("overrides", nargs="*", default=[], help=_OVERRIDES_HELP)

    config = sub.add_parser("config", help="inspect configs", description="Inspect configs.")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    show = config_sub.add_parser(
        "show",
        help="print the resolved config as YAML",
        description="Print the resolved config as YAML (loads back to the same config; a recipe's "
        f"trainer.run_dir is a comment, so a file saved from it runs in runs/<file name>). Recipes: {recipes}.",
    )
    show.add_argument("config", help="recipe name or YAML file")
    show.add_argument("overrides", nargs="*", default=[], help=_OVERRIDES_HELP)
    config_sub.add_parser(
        "doc",
        help="print the configuration reference (Markdown)",
        description="Print every config key with its type, default and description, as Markdown "
        "(docs/config.md is this output).",
    )

    _add_eval_parser(sub)
    _add_export_parser(sub)
    _add_serve_parser(sub)
    plot = sub.add_parser(
        "plot", help="plot a run's curves", description="Write RUN_DIR/curves.png from metrics.jsonl."
    )
    plot.add_argument("run_dir", help="run folder holding metrics.jsonl")
    init = sub.add_parser(
        "init-model",
        help="write a tiny random test model",
        description="Write a tiny random model with a character tokenizer as a Hugging Face folder, for "
        "trying settings and parallel layouts on a CPU in seconds (model.path=DIR): tiny-dense (Qwen3), "
        "tiny-moe (Qwen3-MoE, 8 experts), tiny-mla (DeepSeek-V3: MLA attention, MoE with a shared expert) "
        "tiny-vl (Qwen2.5-VL: a vision tower, M-RoPE) or tiny-vl3 (Qwen3-VL: DeepStack, interleaved M-RoPE).",
    )
    init.add_argument("kind", choices=TINY_KINDS)
    init.add_argument("out", help="new or empty output folder")
    init.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    init.add_argument("--hidden", type=int, default=32, help="hidden size, a multiple of 8 (default 32)")
    _add_compare_parser(sub)
    _add_plan_parser(sub)
    return parser


def _add_eval_parser(sub: argparse._SubParsersAction) -> None:
    evaluate = sub.add_parser(
        "eval",
        help="score a model or run on a dataset",
        description="Accuracy of a model (Hugging Face folder, run folder or checkpoint) on a dataset "
        "(.jsonl/.parquet file, or arithmetic/countdown) with the task's reward: a table and a JSON line. "
        "A run's own settings (template, system prompt, reward) are used; overrides apply last.",
    )
    evaluate.add_argument("model", help="Hugging Face folder, run folder or checkpoint")
    evaluate.add_argument("data", help=".jsonl or .parquet file (every row), or arithmetic/countdown")
    evaluate.add_argument(
        "overrides", nargs="*", default=[], help="dotted overrides such as data.system_prompt='...'"
    )
    evaluate.add_argument("--samples", type=int, default=1, help="answers per prompt (pass@k for k > 1)")
    evaluate.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="sampling temperature (default: rollout.eval_temperature, 0 = greedy)",
    )
    evaluate.add_argument(
        "--responses",
        metavar="FILE",
        help="also write every answer and its score to this new jsonl file (an existing path is refused)",
    )


def _add_export_parser(sub: argparse._SubParsersAction) -> None:
    export = sub.add_parser(
        "export",
        help="write a run's trained model as a Hugging Face folder",
        description="Write the policy of a checkpoint (or of a run folder's newest complete checkpoint) as a "
        "Hugging Face folder: config.json, tokenizer files and safetensors, loadable by transformers' "
        "AutoModelForCausalLM and servable by vLLM/SGLang.",
    )
    export.add_argument("source", help="run folder (RUN_DIR) or checkpoint (RUN_DIR/checkpoints/step_N)")
    export.add_argument("out", help="new or empty output folder")
    export.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default="auto",
        help="safetensors dtype; auto keeps the starting model's own dtype (its config.json)",
    )
    export.add_argument(
        "--critic",
        action="store_true",
        help="export the critic of a PPO run (algorithm.estimator=gae) instead: a value model "
        "(transformers' *ForTokenClassification, one label) that critic.model_path loads",
    )


def _add_compare_parser(sub: argparse._SubParsersAction) -> None:
    compare = sub.add_parser(
        "compare-layers",
        help="compare the rollout's decode with the training forward, layer by layer",
        description="Sample a response to PROMPT with the rollout engine, recompute it with the training "
        "forward, and print each layer's largest hidden-state difference and the first layer that differs "
        "(rlloom/engines/compare_layers.py). MODEL: a Hugging Face folder, e.g. RUN_DIR/hf/step_N.",
    )
    compare.add_argument("model", help="model folder")
    compare.add_argument("--prompt", required=True, help="prompt text (tokenized as is, no chat template)")
    compare.add_argument("--max-new-tokens", type=int, default=16, help="response tokens (default 16)")
    compare.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    compare.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    compare.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    compare.add_argument(
        "--exact", action="store_true", help="both sides with rollout.match_training's numerics (CPU)"
    )


def _add_serve_parser(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser(
        "serve",
        help="serve a model or run on an OpenAI-compatible endpoint",
        description="Serve a model (Hugging Face folder, run folder or checkpoint) on the OpenAI-compatible "
        "endpoint training uses for rollout.agent: GET /v1/models, POST /v1/chat/completions and "
        "/v1/completions. A run's own settings are used; overrides apply last. Needs rlloom[serve].",
    )
    serve.add_argument("model", help="Hugging Face folder, run folder or checkpoint")
    serve.add_argument(
        "overrides", nargs="*", default=[], help="dotted overrides such as rollout.max_new_tokens=512"
    )
    serve.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0: any free port)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")


def _add_plan_parser(sub: argparse._SubParsersAction) -> None:
    plan = sub.add_parser(
        "plan",
        help="predict memory and recommend a parallel layout",
        description="Predict per-GPU and per-node memory of RL training and recommend TP/PP/CP/EP and "
        "optimizer offload for a model and a GPU count, with the `rlloom train` overrides that run the "
        "layout (docs/plan.md). Exit 0: a layout fits; 1: none fits.",
    )
    plan.add_argument(
        "model",
        help="Hugging Face model folder or its config.json (no weights needed), or a model whose published "
        "config rlloom ships, e.g. qwen3-8b, qwen3-30b-a3b, deepseek-v3 (an unknown name lists them)",
    )
    plan.add_argument("--gpus", type=int, required=True, help="number of GPUs")
    plan.add_argument("--gpu-memory-gb", type=float, required=True, help="memory of one GPU in GB")
    plan.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    plan.add_argument(
        "--cpu-memory-gb-per-node",
        type=float,
        default=0.0,
        help="host memory per node in GB (0: not checked)",
    )
    plan.add_argument(
        "--max-tokens-per-gpu",
        type=int,
        default=8192,
        help="tokens of one micro-batch per GPU (default 8192)",
    )
    plan.add_argument("--recompute", choices=("full", "selective", "none"), default="full")
    plan.add_argument(
        "--images-per-gpu",
        type=int,
        default=1,
        help="a vision-language model: pictures in one micro-batch of one GPU, each as large as the model "
        "folder's image processor writes them (default 1)",
    )
    plan.add_argument(
        "--rollout-quantization",
        choices=("none", "fp8"),
        default="none",
        help="the rollout's weights, as rollout.quantization: fp8 holds the routed experts in fp8",
    )
    plan.add_argument(
        "--critic",
        action="store_true",
        help="PPO with a critic (algorithm.estimator=gae) started from the same model: its weights and "
        "moments stay on the GPUs beside the policy's",
    )
    plan.add_argument(
        "--teacher",
        metavar="MODEL",
        help="on-policy distillation's teacher (teacher.path), named as MODEL is: forward-only on the "
        "training GPUs beside the policy, its weights in the compute dtype",
    )
    plan.add_argument(
        "--teacher-offload",
        action="store_true",
        help="the teacher's weights wait on the host between its forwards (teacher.offload)",
    )
    plan.add_argument(
        "--reward-model",
        metavar="MODEL",
        help="a reward model (reward.model_path), named as MODEL is: whole on the first GPU (the trainer's)",
    )
    plan.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="train LoRA adapters of this rank instead of every weight (train.lora_rank; 0: full fine-tuning)",
    )
    plan.add_argument(
        "--lora-target-modules",
        default="all-linear",
        help="the projections LoRA adapts, as train.lora_target_modules (default all-linear)",
    )
    plan.add_argument("--check", help="evaluate one layout, e.g. tp=8,pp=12,cp=1,ep=8,offload=1.0")
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    plan.error = _plan_usage_error  # type: ignore[method-assign]


def _plan_usage_error(message: str) -> NoReturn:
    # One line and exit code 2 for a bad `rlloom plan` command line, like every other user error.
    print(f"rlloom: error: plan: {message}. Fix: see `rlloom plan --help`.", file=sys.stderr)
    sys.exit(2)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command in ("train", "sft"):  # `| tee` and Ctrl-C: the run finishes its step without its console
        from rlloom.observability.pipes import console_may_close

        with console_may_close():
            return _command(args)
    return _command(args)


def _compare_layers(args: argparse.Namespace) -> int:
    """`rlloom compare-layers`: the layer-by-layer diff of the rollout engine against training."""
    import torch

    from rlloom.engines.compare_layers import compare_layers
    from rlloom.models import load_tokenizer

    prompt_ids = load_tokenizer(args.model)(args.prompt)["input_ids"]
    report = compare_layers(
        args.model,
        prompt_ids,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        device=args.device,
        dtype=getattr(torch, args.dtype),
        exact=args.exact,
    )
    print(report.table())
    return 0


def _train(args: argparse.Namespace) -> int:
    """`rlloom train` and `rlloom sft`: 1 when every update was skipped, 128 + the signal after a stop."""
    from rlloom.config.loading import load_config
    from rlloom.trainer.run import TrainingStalled, run
    from rlloom.trainer.sft import run_sft
    from rlloom.trainer.stop import RunStopped

    cfg = load_config(args.config, args.overrides)
    try:
        run_sft(cfg) if args.command == "sft" else run(cfg)
    except TrainingStalled as e:
        print(f"rlloom: error: {e}", file=sys.stderr)
        return 1
    except RunStopped as e:
        print(f"rlloom: {e}", file=sys.stderr)
        return e.exit_code
    return 0


def _command(args: argparse.Namespace) -> int:
    try:
        if args.command == "config" and args.config_command == "doc":
            from rlloom.config.doc import config_reference

            print(config_reference(), end="")
            return 0
        if args.command == "config":
            from rlloom.config.loading import show_config

            print(show_config(args.config, args.overrides), end="")
            return 0
        if args.command == "plan":
            from rlloom.plan.report import run_plan

            return run_plan(args)
        if args.command == "plot":
            from rlloom.observability.plot import plot_run

            print(plot_run(args.run_dir))
            return 0
        if args.command == "eval":
            from rlloom.trainer.eval_model import eval_model

            report = eval_model(
                args.model,
                args.data,
                args.overrides,
                samples=args.samples,
                temperature=args.temperature,
                responses=args.responses,
            )
            print(report.table())
            print(report.json_line())
            return 0
        if args.command == "serve":
            from rlloom.trainer.serve_model import serve_model

            serve_model(args.model, args.overrides, host=args.host, port=args.port)
            return 0
        if args.command == "init-model":
            from rlloom.models.tiny import write_tiny_model
            from rlloom.trainer.export import check_output

            print(
                write_tiny_model(
                    args.kind,
                    check_output(args.out, "init-model output"),
                    hidden=args.hidden,
                    layers=args.layers,
                )
            )
            return 0
        if args.command == "compare-layers":
            return _compare_layers(args)
        if args.command == "export":
            from rlloom.trainer.export import export_checkpoint

            print(export_checkpoint(args.source, args.out, dtype=args.dtype, critic=args.critic))
            return 0
        return _train(args)
    except (UserError, CheckpointError, FileNotFoundError) as e:
        print(f"rlloom: error: {_one_line(str(e))}", file=sys.stderr)
        return 2
    except WorkerFailure as e:
        print(f"rlloom: worker failure: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C outside a run's steps, or twice within them
        print(f"rlloom: interrupted (Ctrl-C); {_INTERRUPTED[args.command]}", file=sys.stderr)
        return 128 + signal.SIGINT
    except BrokenPipeError:  # stdout closed early (`rlloom plan ... | head`): stop quietly, as cat does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush must not fail
        return 128 + signal.SIGPIPE


_INTERRUPTED = {
    "train": "a run keeps its checkpoints up to the last one written: continue with trainer.resume=auto",
    "sft": "a run keeps its checkpoints up to the last one written: continue with trainer.resume=auto",
    "eval": "no report was written",
    "export": "the output folder may be incomplete: remove it and export again",
    "plan": "nothing was written",
    "plot": "nothing was written",
    "serve": "the endpoint stopped",
    "config": "nothing was written",
    "init-model": "the output folder may be incomplete: remove it and run again",
    "compare-layers": "nothing was written",
}


def _one_line(message: str) -> str:
    """A user error's message on one line (a multi-line message would read as a traceback)."""
    return " ".join(message.split())


if __name__ == "__main__":
    sys.exit(main())
