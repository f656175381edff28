"""Continuous GRPO on the CPU: ``tito run --follow`` samples while this process trains, then held-out
accuracy of the base and the final weights.

    python scripts/rl_loop.py RUN_DIR [--config configs/rl_loop.yaml] [--steps 25] [--lr 3e-5]
                              [--set key=value ...] [--no-service] [--eval-tasks 64] [--threads 1]

It starts ``tito run CONFIG --follow RUN_DIR --set follow.max_steps=STEPS`` as a subprocess (its output in
``RUN_DIR/service.log``) and trains here, in the loop of :func:`train`: for each step k, wait for batch k
(``read_step``), take one GRPO step on it (clipped surrogate on the sampler's logprobs, AdamW), publish the
weights as version k (``publish_weights``: the service loads them into its engines mid-run) and log a line
to ``RUN_DIR/trainer.jsonl``: reward, importance-ratio statistics, staleness ((k - 1) - the oldest version
that sampled a token of the batch), seconds spent waiting, training and publishing. At the end it scores
the base model and the last published weights greedily on held-out tasks (the environment's generator
with another seed, minus any prompt in the training pool), writes ``RUN_DIR/eval.json`` and plots the
reward per step to ``RUN_DIR/reward.png`` (matplotlib, else Pillow, else no plot: said in one line).

``--lora`` trains a peft LoRA adapter (``--lora-rank``, ``--lora-alpha``; every linear layer of the attention and
MLP) on the frozen base and publishes only the adapter each step (``publish_adapter``: ``adapter_model.safetensors``
+ ``adapter_config.json``, what prime-rl's LoRA runs write): the service loads it as that version of its adapter
and samples the next batches with it; the evaluation scores the base and base + the last adapter.

``--weights gloo`` sends each step's weights over a gloo group instead of writing a checkpoint (what TRL, SkyRL and
vLLM's own RL examples do with NCCL on GPUs): the service runs with ``follow.weights: wire`` and
``engine.weight_transfer: gloo`` and listens on loopback (``--listen-port``, 0: a free one); the trainer sends with
``rollout.engines.gloo_sender.GlooWeightSender`` (``send(model.named_parameters(), version=k)``). Nothing lands in
``broadcasts/``; the final weights are written once, to ``RUN_DIR/trained/``, for the evaluation. Such a run cannot
be resumed (the weights lived only in the service's engines), nor combined with ``--lora``.

``--no-service`` trains on batches that something else writes (another ``tito run --follow``, or
step directories made by hand with ``tito run CONFIG --out RUN_DIR/rollouts/step_k``). A RUN_DIR that
already holds published weights is resumed at ``latest_version + 1`` (the service resumes likewise).

Micro-batches (``--layout``): ``prefix`` (default) scores each group of samples that share a prompt with one
forward pass of the prompt, its KV repeated for the completions (exact: the same logprobs as a packed pass,
the gradient through the shared prompt included: within 2e-5 of ``packed``). ``packed`` is rollout.data.packing's
pack + packed_logprobs in rows of ``--budget`` tokens, which scores every sample's prompt again. Measured on
configs/rl_loop.yaml's first batch (32 trained samples, 2158 tokens, 1 thread, idle 2-core EPYC): forward +
backward 18.7 s prefix, 35.2 s packed at budget 1024, 47.1 s at 4096 (peak RSS 6.5 GB: the dense [L, L]
block-causal mask of a long packed row).
"""

from __future__ import annotations

import _thread
import argparse
import asyncio
import inspect
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rollout.config import RunConfig, load_config
from rollout.data import Sample, read_step
from rollout.data.layout import broadcast_dir, is_sealed
from rollout.data.packing import PackedRow, pack, packed_logprobs, sampling_log_softmax
from rollout.follow.publish import latest_version, publish_adapter, publish_weights
from rollout.models import load_causal_lm

REPO = Path(__file__).resolve().parent.parent
TRAINER_LOG = "trainer.jsonl"


# -- the trainer ------------------------------------------------------------------------------------------------

def train(run_dir: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, *, max_off_policy: int,
          timeout: float, layout: str = "prefix", budget: int = 1024, eps: float = 0.2,
          sampling: dict[str, float] | None = None, lora: bool = False, sender: Any = None) -> None:
    """The trainer: one GRPO step per sealed batch, each published as the next weight version. ``sampling``
    (temperature, top_p, top_k of the service) makes the new logprobs those of the distribution sampled from.
    ``lora``: ``model`` is a peft model; only its adapter is published. ``sender``: a joined GlooWeightSender,
    which sends the weights to the service instead of a checkpoint."""
    def publish(run_dir: Path, k: int, model: torch.nn.Module) -> None:
        if sender is not None:
            if is_sealed(run_dir, steps):  # the service sealed its last batch and stopped: it needs no more weights
                return
            try:
                sender.send([(n, p.detach()) for n, p in model.named_parameters()], version=k)
            except Exception:
                if not is_sealed(run_dir, steps):  # (it may have sealed and stopped during the send)
                    raise
        else:
            (publish_adapter if lora else publish_weights)(run_dir, k, model)

    for k in range(latest_version(run_dir) + 1, steps + 1):
        t0 = time.monotonic()
        batch = read_step(run_dir, k, timeout=timeout, min_weight_version=k - 1 - max_off_policy)  # waits
        t1 = time.monotonic()
        trained = [s for s in batch if s.advantage != 0]        # equal rewards in a group: no gradient
        n_tokens = max(1, sum(int(np.count_nonzero(s.loss_mask)) for s in trained))
        ratios = []
        for mb in micro_batches(trained, layout, budget, seed=k):
            new, old, adv, mask = score(model, mb, **(sampling or {}))  # per token; grad flows into `new`
            ratio = torch.exp(new - old)
            surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - eps, 1 + eps) * adv)
            (-(surrogate * mask).sum() / n_tokens).backward()  # token mean over the batch
            ratios.append(ratio.detach()[mask])
        if trained:                                            # else AdamW's momentum alone would move it
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
        t2 = time.monotonic()
        publish(run_dir, k, model)                             # broadcasts/step_k/ (STABLE last), or gloo
        log_step(run_dir, k, batch.samples, trained, ratios, eps,
                 wait_s=t1 - t0, train_s=t2 - t1, publish_s=time.monotonic() - t2)


# -- micro-batches and their logprobs --------------------------------------------------------------------------

@dataclass
class Group:
    """Samples that start with the same prompt (the tokens before the first trainable one)."""

    prompt: list[int]
    samples: list[Sample]


def micro_batches(samples: Sequence[Sample], how: str, budget: int, seed: int) -> Iterator[Group | PackedRow]:
    if how == "packed":
        yield from pack(samples, budget, seed=seed)
        return
    groups: dict[tuple[int, ...], list[Sample]] = {}
    for s in samples:
        first = int(np.argmax(s.loss_mask))  # every sample here has a trainable token
        groups.setdefault(tuple(int(t) for t in s.token_ids[:first]), []).append(s)
    for prompt, members in groups.items():
        yield Group(list(prompt), members)


def score(model: torch.nn.Module, mb: Group | PackedRow, temperature: float = 1.0, top_p: float = 1.0,
          top_k: int = 0) -> tuple[torch.Tensor, ...]:
    """(new logprobs, sampler logprobs, advantages, loss mask) of a micro-batch, aligned, same shape. The
    new logprobs are of the distribution the engine sampled from (rollout.data.packing.sampling_log_softmax)."""
    if isinstance(mb, PackedRow):
        new = packed_logprobs(model, mb, temperature=temperature, top_p=top_p, top_k=top_k)
        return new, *(torch.from_numpy(a) for a in (mb.inference_logprobs, mb.advantages, mb.loss_mask))
    p, n = len(mb.prompt), len(mb.samples)
    width = max(len(s) for s in mb.samples) - p
    ids = torch.zeros(n, width, dtype=torch.long)
    old, adv = torch.zeros(n, width), torch.zeros(n, width)
    mask, real = torch.zeros(n, width, dtype=torch.bool), torch.zeros(n, width, dtype=torch.long)
    for i, s in enumerate(mb.samples):
        m = len(s) - p
        ids[i, :m] = torch.from_numpy(np.array(s.token_ids[p:], dtype=np.int64))
        mask[i, :m] = torch.from_numpy(np.array(s.loss_mask[p:], dtype=bool))
        old[i, :m] = torch.from_numpy(np.array(s.logprobs[p:], dtype=np.float32))  # a copy: Arrow views are read-only
        adv[i, :m] = s.advantage
        real[i, :m] = 1
    cache = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    head = model(input_ids=torch.tensor([mb.prompt]), use_cache=True)
    kv = getattr(head, cache)
    kv.batch_repeat_interleave(n)                             # the prompt's KV for every completion
    tail = model(input_ids=ids, attention_mask=torch.cat([torch.ones(n, p, dtype=torch.long), real], 1),
                 position_ids=(p + torch.arange(width)).expand(n, width), use_cache=False, **{cache: kv})
    logits = torch.cat([head.logits[:, -1:].expand(n, 1, -1), tail.logits[:, :-1]], 1).float()
    logp = sampling_log_softmax(logits.reshape(n * width, -1), temperature, top_p, top_k).reshape(n, width, -1)
    new = logp.gather(2, ids[..., None])[..., 0]
    return new, old, adv * mask, mask


# -- metrics ----------------------------------------------------------------------------------------------------

def log_step(run_dir: Path, k: int, samples: Sequence[Sample], trained: Sequence[Sample], ratios: list, eps: float,
             **seconds: float) -> dict[str, Any]:
    rewards = [float(s.meta.get("reward") or 0.0) for s in samples]
    versions = [s.versions()[np.asarray(s.loss_mask, dtype=bool)] for s in samples]
    oldest = min((int(v.min()) for v in versions if v.size), default=k - 1)
    r = torch.cat(ratios).double() if ratios else torch.ones(1, dtype=torch.float64)
    line = {
        "step": k, "samples": len(samples), "trained_samples": len(trained),
        "trained_tokens": int(sum(np.count_nonzero(s.loss_mask) for s in trained)),
        "reward_mean": float(np.mean(rewards)) if rewards else None,
        "completion_tokens_mean": float(np.mean([v.size for v in versions])) if versions else None,
        "ratio": {"mean": float(r.mean()), "min": float(r.min()), "max": float(r.max()),
                  "clipped": float(((r - 1).abs() > eps).double().mean())},
        "staleness": (k - 1) - oldest,
        "staleness_token_mean": float(np.mean(np.concatenate([(k - 1) - v for v in versions])))
        if any(v.size for v in versions) else 0.0,
        **{key: round(value, 3) for key, value in seconds.items()},
    }
    with open(run_dir / TRAINER_LOG, "a", encoding="utf-8") as f:
        f.write(json.dumps(line) + "\n")
    print(f"step {k:3d}  reward {line['reward_mean']:.3f}  ratio {line['ratio']['mean']:.4f} "
          f"[{line['ratio']['min']:.3f}, {line['ratio']['max']:.3f}]  staleness {line['staleness']}  "
          f"wait {seconds['wait_s']:.1f}s  train {seconds['train_s']:.1f}s  publish {seconds['publish_s']:.1f}s",
          flush=True)
    return line


# -- the rollout service ---------------------------------------------------------------------------------------

def tito_command() -> list[str]:
    exe = Path(sys.executable).with_name("tito")
    return [str(exe)] if exe.is_file() else [sys.executable, "-m", "actors.cli"]


def free_port() -> int:
    """A port free now on loopback (another process could take it before the service binds it: the service then
    says so in one line and this script stops)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gloo_sender(url: str, timeout_s: float) -> Any:
    """A GlooWeightSender joined to the service's engines: ``/health`` polled until the service is up (it loads its
    engines first), then ``init()``."""
    import urllib.error
    import urllib.request

    from rollout.engines.gloo_sender import GlooWeightSender

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=10) as answer:
                if answer.status == 200:
                    break
        except (urllib.error.URLError, OSError):
            if time.monotonic() > deadline:
                raise
            time.sleep(1)
    sender = GlooWeightSender(url, timeout_s=120.0, api_key=os.environ.get("TITO_ADMIN_API_KEY"))
    sender.init()
    return sender


def start_service(config: str, run_dir: Path, steps: int, overrides: Sequence[str]) -> subprocess.Popen:
    cmd = [*tito_command(), "run", config, "--follow", str(run_dir), "--set", f"follow.max_steps={steps}"]
    for item in overrides:
        cmd += ["--set", item]
    log = open(run_dir / "service.log", "ab")  # noqa: SIM115 - the child holds it for its whole life
    print("service:", " ".join(cmd), f"(log: {run_dir / 'service.log'})", flush=True)
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def watch(proc: subprocess.Popen, done: threading.Event) -> None:
    """Interrupt the trainer (KeyboardInterrupt in the main thread) when the service fails first, so it does
    not wait out read_step's timeout for a batch that will never come."""
    rc = proc.wait()
    if rc != 0 and not done.is_set():
        print(f"tito run --follow exited with {rc} before the trainer finished", file=sys.stderr, flush=True)
        _thread.interrupt_main()


def stop_service(proc: subprocess.Popen, grace_s: float = 60.0) -> int | None:
    """Let the service end on its own (it stops after follow.max_steps batches), else SIGINT it."""
    try:
        return proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # sealed batches stay intact; unsealed ones are removed
        try:
            return proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()


# -- held-out evaluation ----------------------------------------------------------------------------------------

def lora_model(base: str, resume: Path | None, rank: int, alpha: float) -> torch.nn.Module:
    """The base model with a trainable LoRA adapter on every attention and MLP projection (B = 0 at first: step 0
    samples the base model), or the adapter of ``resume`` (a published step) to go on training."""
    import peft

    model = load_causal_lm(str(base))
    if resume is not None:
        return peft.PeftModel.from_pretrained(model, str(resume), is_trainable=True)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return peft.get_peft_model(model, peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets,
                                                      lora_dropout=0.0))


def held_out_tasks(cfg: RunConfig, n: int, seed: int) -> list:
    """``n`` tasks from the environment's generator with ``seed``, none with a prompt of the training pool."""
    from rollout.envs import load_tasks, make_env

    env = make_env(cfg.env.name, **cfg.env.options)
    pool = (load_tasks(cfg.tasks.path).tasks[: cfg.tasks.count] if cfg.tasks.path
            else env.generate_tasks(cfg.tasks.count or 8, cfg.tasks.seed))
    seen = {json.dumps(t.messages, sort_keys=True) for t in pool}
    fresh = [t for t in env.generate_tasks(20 * n, seed) if json.dumps(t.messages, sort_keys=True) not in seen]
    unique = list({json.dumps(t.messages, sort_keys=True): t for t in fresh}.values())
    return unique[:n]


def evaluate(cfg: RunConfig, tasks: list, weights: dict[str, tuple[str | None, int]], threads: int) -> dict:
    """Greedy first answers to ``tasks`` under each named weight version (None = the config's model): the
    environment's score of each, averaged (reward and its components)."""
    from rollout.engines.embedded import EmbeddedEngine
    from rollout.engines.lora import is_adapter_dir
    from rollout.engines.protocol import GenerateRequest, SamplingParams
    from rollout.envs import make_env
    from rollout.startup import create_parser, find_model

    model_path = str(find_model(cfg.model))
    parser = create_parser(cfg.renderer, model_path)
    env = make_env(cfg.env.name, **cfg.env.options)
    sampling = SamplingParams(max_tokens=cfg.max_tokens_per_turn, temperature=0.0,
                              stop_token_ids=tuple(parser.stop_token_ids))

    async def one(engine, name: str, i: int, task, lora: str | None) -> dict[str, float]:
        prompt = prompts[i]
        out = await engine.generate(GenerateRequest(f"eval-{name}-{i}", list(prompt), sampling, lora=lora))
        parsed = parser.parse_response(out.results[0].completion_ids, prompt, env.tools)
        state = env.reset(task)
        await env.step(state, parsed)
        s = env.score(state, [*task.messages, parsed.to_message()])
        return {"reward": s.reward, **s.components}

    prompts = [parser.render(t.messages, env.tools, add_generation_prompt=True).token_ids for t in tasks]
    width = max(map(len, prompts)) + cfg.max_tokens_per_turn  # the engine's KV buffer: no wider than needed

    async def run() -> dict:
        engine = EmbeddedEngine(model_path, threads=threads, max_batch=min(64, len(tasks)), max_model_len=width)
        results = {}
        try:
            for name, (path, version) in weights.items():
                lora = None
                if path is not None and is_adapter_dir(path):  # base + that adapter
                    lora = name
                    await engine.load_lora_adapter(name, path, version)
                elif path is not None:
                    await engine.update_weights(path, version)
                rows = await asyncio.gather(*(one(engine, name, i, t, lora) for i, t in enumerate(tasks)))
                results[name] = {key: float(np.mean([r[key] for r in rows])) for key in rows[0]}
        finally:
            await engine.close()
        return results

    return asyncio.run(run())


# -- the plot ---------------------------------------------------------------------------------------------------

def plot(run_dir: Path, out: Path) -> str:
    """Reward per step (the trainer's log) as a PNG; says what it did."""
    log = run_dir / TRAINER_LOG
    lines = [json.loads(x) for x in log.read_text().splitlines() if x.strip()] if log.is_file() else []
    steps = [x["step"] for x in lines]
    reward = [x["reward_mean"] for x in lines]
    if not steps:
        return "no steps to plot"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        plt = None
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(steps, reward, marker="o")
        ax.set_xlabel("trainer step (batch k)")
        ax.set_ylabel("mean reward of batch k")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out, dpi=120)
        return f"plot: {out}"
    try:
        from PIL import Image, ImageDraw
    except ImportError:
        return "no plot: neither matplotlib nor Pillow is installed (pip install matplotlib)"
    w, h, m = 640, 360, 48
    img = Image.new("RGB", (w, h), "white")
    d = ImageDraw.Draw(img)
    lo, hi = min(0.0, min(reward)), max(reward) or 1.0
    x0, x1 = min(steps), max(max(steps), min(steps) + 1)

    def xy(s: float, r: float) -> tuple[float, float]:
        return m + (s - x0) / (x1 - x0) * (w - 2 * m), h - m - (r - lo) / ((hi - lo) or 1.0) * (h - 2 * m)

    d.rectangle([m, m, w - m, h - m], outline="gray")
    d.line([xy(s, r) for s, r in zip(steps, reward)], fill="royalblue", width=2)
    for s, r in zip(steps, reward):
        x, y = xy(s, r)
        d.ellipse([x - 3, y - 3, x + 3, y + 3], fill="royalblue")
    d.text((m, 12), "mean reward of batch k per trainer step", fill="black")
    d.text((m, h - m + 8), f"step {x0}", fill="black")
    d.text((w - m - 50, h - m + 8), f"step {x1}", fill="black")
    d.text((4, m - 6), f"{hi:.2f}", fill="black")
    d.text((4, h - m - 6), f"{lo:.2f}", fill="black")
    img.save(out)
    return f"plot (Pillow; matplotlib is not installed): {out}"


# -- main -------------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir")
    ap.add_argument("--config", default=str(REPO / "configs" / "rl_loop.yaml"))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config overrides (service too)")
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--layout", choices=("prefix", "packed"), default="prefix")
    ap.add_argument("--budget", type=int, default=1024, help="packed layout: tokens per row")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds to wait for one batch")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the trainer (and the evaluation)")
    ap.add_argument("--eval-tasks", type=int, default=64, help="held-out tasks (0: no evaluation)")
    ap.add_argument("--eval-seed", type=int, default=10_000)
    ap.add_argument("--no-service", action="store_true", help="train on batches something else writes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lora", action="store_true", help="train a LoRA adapter; publish only the adapter")
    ap.add_argument("--lora-rank", type=int, default=8)
    ap.add_argument("--lora-alpha", type=float, default=16.0)
    ap.add_argument("--weights", choices=("files", "gloo"), default="files",
                    help="how the trainer's weights reach the service: checkpoints in RUN_DIR/broadcasts, or gloo")
    ap.add_argument("--listen-port", type=int, default=0, help="--weights gloo: the service's port (0: a free one)")
    args = ap.parse_args(argv)
    if args.weights == "gloo":
        if args.lora or args.no_service:
            ap.error("--weights gloo sends full weights to the service this script starts: not with --lora or "
                     "--no-service")
        port = args.listen_port or free_port()
        args.set = [*args.set, "engine.weight_transfer=gloo", "follow.weights=wire",
                    f"follow.listen=127.0.0.1:{port}"]
        if (Path(args.run_dir) / "rollouts").exists() and any((Path(args.run_dir) / "rollouts").iterdir()):
            ap.error(f"--weights gloo cannot resume {args.run_dir}: the weights it trained lived only in the "
                     "service's engines; use a new RUN_DIR")

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    cfg = load_config(args.config, args.set)
    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    start = latest_version(run_dir)
    proc = None if args.no_service else start_service(args.config, run_dir, args.steps, args.set)
    done = threading.Event()  # set once the trainer finished: a service exit is then expected
    finished = False
    if proc is not None:
        threading.Thread(target=watch, args=(proc, done), daemon=True).start()
    try:
        if args.lora:
            model = lora_model(cfg.model, broadcast_dir(run_dir, start) if start else None, args.lora_rank,
                               args.lora_alpha).train()
        else:
            model = load_causal_lm(str(broadcast_dir(run_dir, start)) if start else cfg.model).train()
        trainable = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0)  # resumed: fresh moments
        sender = None
        if args.weights == "gloo":
            sender = gloo_sender(f"http://127.0.0.1:{port}", timeout_s=args.timeout)
        t0 = time.monotonic()
        train(run_dir, model, opt, args.steps, max_off_policy=cfg.follow.max_off_policy_steps,
              timeout=args.timeout, layout=args.layout, budget=args.budget,
              sampling={"temperature": cfg.sampling.temperature, "top_p": cfg.sampling.top_p,
                        "top_k": cfg.sampling.top_k}, lora=args.lora, sender=sender)
        if sender is not None:
            publish_weights(run_dir / "trained", args.steps, model)  # the only copy on disk: for the evaluation
            try:
                sender.close()
            except Exception:
                if not is_sealed(run_dir, args.steps):  # a service that sealed its last batch has left: fine
                    raise
        finished = True
        done.set()
        print(f"trained {args.steps - start} steps in {time.monotonic() - t0:.0f} s", flush=True)
    except KeyboardInterrupt:
        print(f"interrupted; see {run_dir / 'service.log'}", file=sys.stderr)
        return 130
    finally:
        done.set()
        if proc is not None:
            rc = stop_service(proc, grace_s=60 if finished else 5)
            print(f"service exited with {rc}", flush=True)
    print(plot(run_dir, run_dir / "reward.png"), flush=True)
    if args.eval_tasks:
        tasks = held_out_tasks(cfg, args.eval_tasks, args.eval_seed)
        final = broadcast_dir(run_dir / "trained" if args.weights == "gloo" else run_dir, args.steps)
        result = evaluate(cfg, tasks, {"base": (None, 0), f"step_{args.steps}": (str(final), args.steps)},
                          args.threads)
        result["tasks"] = len(tasks)
        (run_dir / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
        for name, r in result.items():
            if isinstance(r, dict):
                print(f"held-out ({len(tasks)} tasks, greedy) {name}: " + "  ".join(f"{k} {v:.3f}" for k, v in r.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
