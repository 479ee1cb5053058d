import cProfile, pstats, io, time, sys, sysconfig, gc
from pathlib import Path
import torch
from metrale import LLM, SamplingParams
from metrale.bench.acceptance import heldout_prompts
method=sys.argv[1]; B=int(sys.argv[2])
llm=LLM(spec={"method":method,"num_drafts":3}, device="cuda", max_num_seqs=B)
prompts=heldout_prompts(Path(sysconfig.get_paths()["stdlib"]), llm.tokenizer, B, 128)
pp=SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, speculative=False)
sp=SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
for name, params in (("plain", pp), ("spec", sp), ("plain", pp), ("spec", sp)):
    llm.generate(prompts, params, use_tqdm=False); torch.cuda.synchronize()
    t=time.perf_counter(); steps=llm.engine.telemetry.steps
    llm.generate(prompts, params, use_tqdm=False); torch.cuda.synchronize()
    print(name, round(time.perf_counter()-t,4), llm.engine.telemetry.steps-steps, "gc", gc.get_count())
pr=cProfile.Profile(); t=time.perf_counter(); pr.enable()
llm.generate(prompts, sp, use_tqdm=False); torch.cuda.synchronize()
pr.disable(); print("profiled spec", time.perf_counter()-t)
s=io.StringIO(); pstats.Stats(pr,stream=s).sort_stats("tottime").print_stats(30); print(s.getvalue()[:7000])
