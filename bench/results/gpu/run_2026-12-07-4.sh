# device call 4, 2026-12-07 (second session): call 3's A/B (segment commits overlapped with the next
# segment's rows, new, vs one after the other in the writer thread, old: bench/out/old/hs_init.py), 1.25 B,
# 192 equal-length samples, bf16 and fp8-e4m3; then the new stage at 256 samples (bf16), a longer run whose
# start and last commit weigh less. Same machine, one after the other. Make the old file first (git-ignored,
# carried):
#   mkdir -p bench/out/old && git show 456ac2d^:runner/stages/hidden_states/__init__.py > bench/out/old/hs_init.py
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
run() {  # name, timeout, samples, extra options
  timeout $2 python3 bench/gpu_extract.py --out $OUT/gpu_extract_1p25b_$1.json --skip-torch --skip-naive --skip-packed \
    --samples $3 --mixed 0 --budget-s $(( $2 - 20 )) --label "1.25 B" $4 --write-threads "" --disk-gb 1 \
    > $OUT/gpu_extract_1p25b_$1.log 2>&1; echo "$1 rc=$?"
  grep -E "bare forward to|dfcache extract|store path only|disk:|writer_wait" $OUT/gpu_extract_1p25b_$1.log | cut -c1-300
}
HS=runner/stages/hidden_states/__init__.py
cp $HS /tmp/hs_new.py
run new 170 192 --fp8
[ "${ONLY_NEW:-0}" = 1 ] && exit 0  # ONLY_NEW=1: the new stage alone
cp bench/out/old/hs_init.py $HS
run old 120 192 --fp8
cp /tmp/hs_new.py $HS
[ "${WITH256:-1}" = 1 ] && run new256 130 256 ""  # WITH256=0: the A/B alone
