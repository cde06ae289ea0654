#!/usr/bin/env bash
# The GPU machine's driver: ``tools/device_run.sh PHASE...`` from the repository root runs
# each phase in turn under its own time limit and writes logs and results under $OUT, packed
# at the end into $OUT/results.tgz.
#
# A phase named bg:PHASE runs in the background (its output in $OUT/PHASE.out, shown at the
# end); `wait` waits for every background job.
# Phases: tests (the GDN and forward GPU tests), tests_all (every GPU test), tests_shards
# (every GPU test in TEST_SHARDS processes side by side), variants (the
# long sequence with forced chunk / segment choices, KDA and GDN), gdn (benchmarks/ops.py's
# GDN rows against FLA), kda (the KDA forward and training rows against FLA and FlashKDA),
# sweep (the long-sequence sweep with its plot), baseline (the GDN rows from .baseline,
# an earlier commit's kda_ops), fla_suite (FLA's own KDA / GDN tests
# against kda-ops), fuzz (tools/fuzz.py: FUZZ_CASES cases of FUZZ_SEED, each in its own
# process), probe (tools/recurrence_probe.py: the bf16 chunk path by kernel and
# launch setting), memcheck (its unmasked 64-token case under compute-sanitizer), models
# (benchmarks/transformers_models.py: each transformers hybrid
# family under FLA eager, stock torch.compile and kda-ops, MODELS families, default all,
# inside BENCH_S), sanitize (compute-sanitizer on the open faults and wrong answers, in
# the background, SANITIZE_S each; the fuzz cases FUZZ_INDICES rerun alone; with .branch/
# (a `git archive` of another branch's kda_ops) its fuzz case 3 too; `wait` waits for
# them; SANITIZE_JOBS names a subset), tests_files (each GPU test file alone, TEST_FILES),
# matrix_wide (the head-dim matrix's bf16 cells past 128 key columns), wide_keys (their
# time against fp32 copies), wy_probe / branch_tests / branch_gdn (the kda_ops of BRANCH,
# default .branch, a `git archive` of another branch: its scalar-gate WY kernel in launch
# variants, its GPU tests BRANCH_TESTS, its GDN rows BRANCH_ROWS), branch_variants (its
# GDN long case by forced chunk and segments), ab (benchmarks/ab.py: AB_TREES with AB_ARGS,
# AB_NAME names its JSON), forms (tools/recurrence_forms.py, FORMS_ARGS), repro32
# (tools/triton_repro_32cols.py), fuzz_wide (the bf16 cases past 128 key columns; FUZZ_ARGS:
# more arguments for the fuzz phase), gdn_split (the GDN training step's kernel times).
# Wheels in .whl/ are installed first (into /tmp/site, ahead of the image's packages), and
# FlashKDA from .peers/FlashKDA where it was built.
# .whl/ holds fla_core-0.6.0 (1.1 MB), einops-0.8.2 (66 kB) and transformers-5.24.0
# (13.5 MB), all py3-none-any. transformers 5.24.0 needs no other wheel: the image's
# transformers 5.17.0 declares the same requirements (huggingface-hub aside: 5.24 takes
# >=1.31,<3, the image has 1.33.0), and the image has them all: tokenizers 0.23.2,
# safetensors 0.8.0, numpy, regex, pyyaml, packaging, filelock, tqdm, typer (accelerate
# 1.15.0 is version-checked at import too). The models are built from configs: no
# tokenizer, no hub access.
# PTXAS: a ptxas for Triton to assemble with (TRITON_PTXAS_PATH), in a Triton cache of its own;
# a .xz file is unpacked first (.ptxas/ptxas-13.4.xz: CUDA 13.4's, 12 MB packed). Triton
# 3.6 bundles ptxas 12.8.93, whose Hopper miscompiles FLA reports (triton-lang/triton#11366,
# fla-org/flash-linear-attention#1262); the machine's own is CUDA 13.0's.
# Limits: TESTS_S, BENCH_S (seconds a phase; a killed phase keeps what it wrote), and
# VARIANTS_S (each of the variants phase's two runs), GDN_S; GDN_ROWS, BASELINE_ROWS:
# ops.py's GDN rows of the gdn and baseline phases.
set -uo pipefail
OUT=${OUT:-/tmp/kda-ops-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FLA_DISABLE_BACKEND_DISPATCH=1 FLA_FLASH_KDA=0
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# Installed once a machine: invocations run side by side share /tmp/site.
if [ -d .whl ] && [ ! -f /tmp/site/.wheels-installed ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && touch /tmp/site/.wheels-installed
fi
[ -d .whl ] && export PYTHONPATH="$PYTHONPATH:/tmp/site"
# The checkout runs from PYTHONPATH, not installed: its entry points (pyproject.toml's
# torch_dynamo_backends, which backend="kda" is looked up by) go in as a dist-info.
mkdir -p /tmp/site/kda_ops_checkout-0.dist-info
printf 'Metadata-Version: 2.1\nName: kda-ops-checkout\nVersion: 0\n' \
    >/tmp/site/kda_ops_checkout-0.dist-info/METADATA
sed -n '/^\[project.entry-points.torch_dynamo_backends\]/,/^$/p' pyproject.toml \
    | sed 's/^\[project.entry-points./[/; s/"//g' >/tmp/site/kda_ops_checkout-0.dist-info/entry_points.txt
case ":$PYTHONPATH:" in *:/tmp/site:*) ;; *) export PYTHONPATH="$PYTHONPATH:/tmp/site" ;; esac
if [ -d .peers/FlashKDA ]; then
    export PYTHONPATH="$PYTHONPATH:$PWD/.peers/FlashKDA"
fi
nvidia-smi --query-gpu=name,memory.used,utilization.gpu --format=csv | tee "$OUT/gpu.txt"
if [ -n "${PTXAS:-}" ]; then
    case "$PTXAS" in
    *.xz)  # unpacked by Python's lzma: the image may have no xz
        python3 -c 'import lzma, sys; sys.stdout.buffer.write(lzma.open(sys.argv[1]).read())' \
            "$PTXAS" >/tmp/ptxas-carried-$$ && chmod +x /tmp/ptxas-carried-$$ && PTXAS=/tmp/ptxas-carried-$$ ;;
    esac
    export TRITON_PTXAS_PATH="$(realpath "$PTXAS")" TRITON_CACHE_DIR=/tmp/triton-cache-ptxas
    "$TRITON_PTXAS_PATH" --version | tail -n 1 | tee "$OUT/ptxas.txt"
fi

TESTS_S=${TESTS_S:-300}
BRANCH=${BRANCH:-.branch}
BENCH_S=${BENCH_S:-300}
FORWARD_TESTS=(
    tests/kda_ops/test_gpu_gdn.py
    tests/kda_ops/test_plan.py
    "tests/kda_ops/test_gpu.py::test_chunk_64_token_steps_against_float64_reference"
    "tests/kda_ops/test_gpu.py::test_chunk_against_float64_reference"
    "tests/kda_ops/test_gpu.py::test_chunk_recurrence_in_segments_against_float64_reference"
    "tests/kda_ops/test_gpu.py::test_chunk_pipelined_windows_match_one_pass"
    "tests/kda_ops/test_gpu.py::test_chunk_states_against_float64_reference"
    "tests/kda_ops/test_gpu.py::test_chunk_against_fla_long"
    "tests/kda_ops/test_gpu.py::test_chunk_extreme_gates_are_finite"
    "tests/kda_ops/test_gpu.py::test_chunk_backward_against_float64_reference"
)

run_phase() {
    local phase=$1
    echo "== $phase $(date -u +%T)"
    case "$phase" in
    tests)
        timeout "$TESTS_S" python3 -m pytest -q -p no:cacheprovider "${FORWARD_TESTS[@]}" \
            2>&1 | tee "$OUT/tests.log" | tail -n 30
        ;;
    tests_files)
        # Each GPU test file in a pytest run of its own (TEST_FILES, default every file that
        # marks gpu tests), TESTS_S each; the failures' short tracebacks in its log.
        files=${TEST_FILES:-$(grep -rlE 'mark\.gpu|pytestmark = pytest\.mark\.gpu' tests --include='test_*.py' | sort)}
        for file in $files; do
            log="$OUT/tests_$(echo "$file" | tr '/:' '__').log"
            timeout "$TESTS_S" python3 -m pytest -q -p no:cacheprovider -m gpu -rfEs --tb=short \
                "$file" >"$log" 2>&1
            echo "$file rc=$? $(tail -n 1 "$log")"
        done
        ;;
    tests_all)
        timeout "$TESTS_S" python3 -m pytest -q -p no:cacheprovider -m gpu tests \
            2>&1 | tee "$OUT/tests_all.log" | tail -n 30
        ;;
    tests_shards)
        # Every GPU test (or those of TEST_FILES) dealt round-robin into TEST_SHARDS pytest
        # processes side by side (default 4), TESTS_S each; a shard's log names its failures,
        # tests_shards.txt holds each shard's last line and the ids it never reached.
        python3 -m pytest --collect-only -q -p no:cacheprovider -m gpu ${TEST_FILES:-tests} \
            2>/dev/null | grep '::' >"$OUT/gpu_test_ids.txt"
        shards=${TEST_SHARDS:-4} pids=()
        for shard in $(seq 0 $((shards - 1))); do
            awk -v n="$shards" -v s="$shard" '(NR - 1) % n == s' "$OUT/gpu_test_ids.txt" \
                >"$OUT/shard_$shard.ids"
            (timeout "$TESTS_S" xargs -d '\n' -a "$OUT/shard_$shard.ids" python3 -m pytest -v \
                -p no:cacheprovider -rfEs --tb=short -m gpu >"$OUT/shard_$shard.log" 2>&1
             echo "shard $shard rc=$? $(tail -n 1 "$OUT/shard_$shard.log")") &
            pids+=($!)
        done >"$OUT/tests_shards.txt"
        wait "${pids[@]}"  # these only: other phases may run in the background
        # -v prints each id with its outcome: what no shard reached is the rest.
        sed -nE 's/^(tests\/.*) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS).*/\1/p' "$OUT"/shard_*.log \
            | sort -u >"$OUT/reached.ids"
        sort "$OUT/gpu_test_ids.txt" | comm -23 - "$OUT/reached.ids" | sed 's/^/not reached: /' \
            >>"$OUT/tests_shards.txt"
        grep -h '^FAILED\|^ERROR' "$OUT"/shard_*.log >>"$OUT/tests_shards.txt"
        cat "$OUT/tests_shards.txt"
        ;;
    variants)
        # The issue's two long cases: GDN 1 x 32768 at 32 value heads, KDA 1 x 131072 at 16.
        timeout "${VARIANTS_S:-$BENCH_S}" python3 benchmarks/long_sequence.py --variants \
            --no-shared-machine --kinds gdn --lengths 32768 --heads 32 --out "$OUT/long_sequence_variants_gdn.json" \
            2>&1 | tail -n 30
        timeout "${VARIANTS_S:-$BENCH_S}" python3 benchmarks/long_sequence.py --variants \
            --no-shared-machine --kinds kda --lengths 131072 --heads 16 --out "$OUT/long_sequence_variants_kda.json" \
            2>&1 | tail -n 30
        ;;
    ab)
        # benchmarks/ab.py over AB_TREES (directories holding a kda_ops: "." this checkout, or
        # a .branch-* archive) with AB_ARGS (e.g. --gdn --forward --length 32768 --heads 32).
        timeout "${AB_S:-$BENCH_S}" python3 benchmarks/ab.py ${AB_TREES:-.} ${AB_ARGS:-} \
            --no-shared-machine --out "$OUT/ab_${AB_NAME:-run}.json" 2>&1 | tail -n 20
        ;;
    forms)
        # tools/recurrence_forms.py: a recurrence step's time, production and transposed state.
        timeout "${FORMS_S:-200}" python3 tools/recurrence_forms.py ${FORMS_ARGS:-} \
            --json "$OUT/recurrence_forms.jsonl" 2>&1 | tail -n 30
        ;;
    branch_variants)
        # The GDN long case's forced chunk / segment variants from BRANCH's kda_ops.
        PYTHONPATH="$PWD/$BRANCH:$PYTHONPATH" timeout "${VARIANTS_S:-$BENCH_S}" \
            python3 benchmarks/long_sequence.py --variants --no-shared-machine --kinds gdn \
            --lengths 32768 --heads 32 --out "$OUT/long_sequence_variants_gdn_${BRANCH#.}.json" \
            2>&1 | tail -n 30
        ;;
    sweep)
        timeout "$BENCH_S" python3 benchmarks/long_sequence.py --no-shared-machine --fla \
            --budget-s $((BENCH_S - 60)) --plot "$OUT/long_sequence.png" \
            --out "$OUT/long_sequence.json" 2>&1 | tail -n 60
        ;;
    probe)
        # The bf16 chunk path's open questions (tools/recurrence_probe.py; PROBE_CASES, a
        # JSON list of cases, in place of its default set).
        timeout "${PROBE_S:-$BENCH_S}" python3 tools/recurrence_probe.py --jobs 8 \
            ${PROBE_CASES:+--cases "$PROBE_CASES"} \
            --json "$OUT/recurrence_probe.jsonl" 2>&1 | tee "$OUT/recurrence_probe.log" | tail -n 80
        ;;
    memcheck)
        # The unmasked 64-token loop under compute-sanitizer's memcheck.
        timeout "${MEMCHECK_S:-120}" compute-sanitizer --tool memcheck python3 tools/recurrence_probe.py --case \
            '{"K": 128, "V": 128, "T": 1000, "chunk": 64, "UNMASKED_FULL_STEPS": true}' \
            2>&1 | tail -n 25 | tee "$OUT/recurrence_probe_memcheck.log"
        ;;
    gdn)
        timeout "${GDN_S:-$BENCH_S}" python3 benchmarks/ops.py --no-shared-machine --rounds 3 \
            --only ${GDN_ROWS:-gdn32k gdn8k gdn_batch gdn64 gdn_training gdn_decode} \
            --out "$OUT/ops_gdn.json" 2>&1 | tail -n 40
        ;;
    baseline)
        # The same GDN rows from the checkout's parent commit (.baseline: `git archive` of
        # kda_ops and lowering), in a process of their own.
        PYTHONPATH="$PWD/.baseline:$PYTHONPATH" timeout "$BENCH_S" python3 benchmarks/ops.py \
            --no-shared-machine --rounds 3 --only ${BASELINE_ROWS:-gdn32k gdn8k gdn64 gdn_training} \
            --out "$OUT/ops_gdn_baseline.json" 2>&1 | tail -n 30
        ;;
    branch_gdn)
        # The GDN rows from BRANCH's kda_ops (BRANCH_ROWS), in a process of their own.
        PYTHONPATH="$PWD/$BRANCH:$PYTHONPATH" timeout "${GDN_S:-$BENCH_S}" python3 benchmarks/ops.py \
            --no-shared-machine --rounds 3 --only ${BRANCH_ROWS:-gdn_training} \
            --out "$OUT/ops_gdn_${BRANCH#.}.json" 2>&1 | tail -n 30
        ;;
    kda)
        timeout "$BENCH_S" python3 benchmarks/ops.py --no-shared-machine --rounds 3 \
            --only chunk64 chunk96 chunk_backward --out "$OUT/ops_kda.json" 2>&1 | tail -n 40
        ;;
    fuzz)
        timeout "${FUZZ_S:-$TESTS_S}" python3 tools/fuzz.py --cases "${FUZZ_CASES:-300}" \
            --seed "${FUZZ_SEED:-0}" --first "${FUZZ_FIRST:-0}" --jobs "${FUZZ_JOBS:-4}" \
            ${FUZZ_ARGS:-} --timeout 240 --out "$OUT/fuzz.jsonl" 2>&1 \
            | tail -n 40
        ;;
    matrix_wide)
        # The head-dim matrix's bf16 cells past 128 key columns: forward and both backwards.
        S=${MATRIX_S:-$BENCH_S}
        timeout "$S" python3 tools/head_dim_matrix.py --dims 192 256 --pairs 256x64 192x128 \
            --dtypes bfloat16 --jobs "${MATRIX_JOBS:-4}" \
            --deadline $((S - 100)) --json "$OUT/head_dim_matrix_wide_bf16.jsonl" 2>&1 | tail -n 40
        ;;
    wide_keys)
        # bf16 past 128 key columns against the same call on fp32 copies.
        timeout "$BENCH_S" python3 benchmarks/wide_keys.py --no-shared-machine \
            --rounds "${ROUNDS:-5}" --out "$OUT/wide_keys.json" 2>&1 | tail -n 20
        ;;
    repro32)
        # A kernel of the recurrence's shape, no kda_ops code: is the 32-column error Triton's?
        timeout "${REPRO_S:-200}" python3 tools/triton_repro_32cols.py --jobs "${REPRO_JOBS:-8}" ${REPRO_ARGS:-} 2>&1 \
            | tee "$OUT/triton_repro_32cols.log" | tail -n 70
        ;;
    wy_probe)
        # The scalar gate's WY kernel (from .branch: `git archive` of kda_ops, tools and
        # tests of another branch) in its launch variants, a process each.
        (cd "$BRANCH" && PYTHONPATH="$PWD:$PYTHONPATH" timeout "${PROBE_S:-$BENCH_S}" \
            python3 tools/wy_probe.py --jobs "${PROBE_JOBS:-6}" \
            --json "$OUT/wy_probe.jsonl" 2>&1 | tail -n 40)
        ;;
    branch_tests)
        # BRANCH's GPU tests (BRANCH_TESTS, default the Gated DeltaNet ones), in its own tree.
        (cd "$BRANCH" && PYTHONPATH="$PWD:$PYTHONPATH" timeout "$TESTS_S" python3 -m pytest -q -p no:cacheprovider -rfEs \
            --tb=short ${BRANCH_TESTS:-tests/kda_ops/test_gpu_gdn.py} 2>&1 \
            | tee "$OUT/tests_${BRANCH#.}.log" | tail -n 30)
        ;;
    fuzz_wide)
        # bf16 past 128 key columns through the chunk kernels, every entry point.
        timeout "${FUZZ_WIDE_S:-150}" python3 tools/fuzz.py --cases 600 --seed "${FUZZ_SEED:-0}" \
            --select dtype=bfloat16 --select K=192,256 \
            --select entry=chunk,chunk_train,segmented,op,verify \
            --jobs "${FUZZ_JOBS:-4}" --timeout 240 --out "$OUT/fuzz_wide.jsonl" 2>&1 | tail -n 40
        ;;
    models)
        # Each family compiles two paths for four cases: name a few in MODELS a command.
        timeout "$BENCH_S" python3 benchmarks/transformers_models.py --no-shared-machine \
            --model ${MODELS:-all} --budget-s $((BENCH_S - 30)) \
            --out "$OUT/transformers_models.json" 2>&1 | tee "$OUT/transformers_models.log" \
            | tail -n 60
        ;;
    sanitize)
        # memcheck: the bf16 64-token recurrence at K = 192 (illegal address) and the GDN
        # bf16 training case; racecheck: K = 256 at one stage and the unmasked loop, wrong.
        S=${SANITIZE_S:-240}
        probe='python3 tools/recurrence_probe.py --case'
        sanitized() {  # name tool command...
            local name=$1 tool=$2
            shift 2
            timeout "$S" compute-sanitizer --tool "$tool" --print-limit 12 "$@" \
                >"$OUT/sanitize_$name.log" 2>&1
            echo "sanitize $name rc=$?" >>"$OUT/sanitize_$name.log"
        }
        jobs=" ${SANITIZE_JOBS:-k192 k256 unmasked fuzz3 branch} "
        [[ $jobs == *" k192 "* ]] && sanitized k192_memcheck memcheck $probe \
            '{"K": 192, "V": 128, "chunk": 64, "T": 200, "BV": 32}' &
        [[ $jobs == *" k256 "* ]] && sanitized k256_racecheck racecheck $probe \
            '{"K": 256, "V": 128, "chunk": 64, "T": 200, "BV": 32}' &
        [[ $jobs == *" unmasked "* ]] && sanitized unmasked_racecheck racecheck $probe \
            '{"K": 128, "V": 128, "T": 100, "chunk": 64, "UNMASKED_FULL_STEPS": true}' &
        [[ $jobs == *" fuzz3 "* ]] && sanitized fuzz3_memcheck memcheck \
            python3 tools/fuzz.py --seed 0 --index 3 &
        if [[ -d $BRANCH && $jobs == *" branch "* ]]; then
            PYTHONPATH="$PWD/$BRANCH:$PYTHONPATH" sanitized branch_fuzz3_memcheck memcheck \
                python3 tools/fuzz.py --seed 0 --index 3 &
        fi
        for index in ${FUZZ_INDICES:-}; do
            timeout "$S" python3 tools/fuzz.py --seed "${FUZZ_SEED:-0}" --index "$index" --json \
                >"$OUT/fuzz_index_$index.json" 2>"$OUT/fuzz_index_$index.err" &
        done
        ;;
    wait)
        wait
        tail -n 6 "$OUT"/sanitize_*.log
        tail -c 1500 "$OUT"/fuzz_index_*.json 2>/dev/null
        ;;
    gdn_split)
        # Where the GDN training step's time goes, kernel by kernel.
        timeout "${GDN_S:-$BENCH_S}" python3 benchmarks/kernel_split.py --no-shared-machine \
            --gdn 32 --heads 16 --length 32768 --out "$OUT/kernel_split_gdn_training.json" \
            2>&1 | tail -n 30
        ;;
    fla_suite)
        timeout "$TESTS_S" python3 tools/fla_suite.py 2>&1 | tee "$OUT/fla_suite.log" | tail -n 30
        ;;
    *)
        echo "unknown phase $phase" >&2
        return 2
        ;;
    esac
}

for phase in "$@"; do
    if [[ $phase == bg:* ]]; then  # in the background, its output to $OUT/NAME.out
        run_phase "${phase#bg:}" >"$OUT/${phase#bg:}.out" 2>&1 &
    else
        run_phase "$phase"
    fi
done
wait
for out in "$OUT"/*.out; do
    [ -e "$out" ] && { echo "== $(basename "$out")"; tail -n 40 "$out"; }
done
echo "== done $(date -u +%T)"
# Everything in one archive: only a few files come back from the device.
(cd "$OUT" && tar czf results.tgz --remove-files --exclude results.tgz -- *)
