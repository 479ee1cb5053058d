"""Session 78: where the shipped model's n-gram speculative output leaves plain output (bf16), and the
plain logprob margin there: a near tie is numerics, a wide margin a bug."""
import sys, sysconfig
from pathlib import Path
from metrale.api import LLM
from metrale.bench.acceptance import heldout_prompts
from metrale.config import SamplingParams
from metrale.default_model import default_model_dir

det = "--deterministic" in sys.argv
drafter = sys.argv[1]
llm = LLM(str(default_model_dir()), device="cuda", max_model_len=128 + 64 + 64, max_num_seqs=64,
          spec={"method": drafter, "num_drafts": 3}, deterministic=det)
prompts = heldout_prompts(Path(sysconfig.get_paths()["stdlib"]), llm.tokenizer, 256, 128)
print("first prompt head:", repr(llm.tokenizer.decode(prompts[0][:24])))
for batch in (1, 8, 64):
    ps = prompts[:batch]
    base = dict(temperature=0.0, max_tokens=64, ignore_eos=True)
    plain = llm.generate(ps, SamplingParams(**base, speculative=False), use_tqdm=False)
    spec = llm.generate(ps, SamplingParams(**base), use_tqdm=False)
    bad = 0
    for j, (a, b) in enumerate(zip(plain, spec)):
        x, y = a.outputs[0].token_ids, b.outputs[0].token_ids
        if x == y:
            continue
        bad += 1
        i = next(k for k in range(len(x)) if x[k] != y[k])
        probe = llm.generate([ps[j] + x[:i]], SamplingParams(temperature=0.0, max_tokens=1, logprobs=3, speculative=False), use_tqdm=False)
        lp = probe[0].outputs[0].logprobs[0]
        top = sorted(((v.logprob, t) for t, v in lp.items()), reverse=True)[:3]
        print(f"batch {batch} prompt {j}: first diff at {i}: plain {x[i]} spec {y[i]}; plain top3 " +
              ", ".join(f"{t}:{l:.4f}" for l, t in top) + f"; margin {top[0][0]-top[1][0]:.4f}")
    print(f"batch {batch} deterministic={det}: {bad}/{batch} differ")
llm.shutdown()
