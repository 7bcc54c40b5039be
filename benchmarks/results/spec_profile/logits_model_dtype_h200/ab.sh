python3 -m pip install -q --no-deps .whl/*.whl >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p /tmp/p && cp -r . /tmp/p/ && cp .xfer2/parent_model.py /tmp/p/verify_service/model.py
H=hub/heads/smollm2-135m-instruct
for r in 1 2 3; do for v in old new; do
  d=.; [ $v = old ] && d=/tmp/p
  (cd $d && timeout 80 python benchmarks/profile_spec_step.py smollm2 --head $H --config dynamic:7:10:59 --exact --context 512 --steps 60 --timeline --out $OUT/spec_${v}_$r.json > /dev/null 2>&1; echo "$v $r rc=$?")
done; done
python3 - <<'P'
import json,os,glob
o=os.environ["OUT"]
for v in ("old","new"):
    rows=[json.load(open(f)) for f in sorted(glob.glob(f"{o}/spec_{v}_*.json"))]
    print(v, [round(r["host_ms_by_phase_unprofiled"]["step"],4) for r in rows], [round(r["device_busy_ms"],4) for r in rows])
P
EAGLE3_TEST_DEVICE=cuda timeout 400 python -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py tests/test_model.py tests/test_sampling.py tests/test_gpu.py tests/test_eagle_speculative.py 2>&1 | tail -3
