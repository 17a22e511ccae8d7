# The legs' shared steps, sourced by .ci/run and tools/sweep (bash, `set -euo pipefail`).

_LEG_ROWS=()
_LEG_STARTED=$SECONDS
_LEG_RUNNING=""  # the leg under way, and when it started
_LEG_LOGS=${_LEG_LOGS:-$PWD/.ci-logs}  # what `beside` legs print, and how each ended
_LANE_LAST=""    # the `beside` leg started last: the next one runs after it
# each `beside` leg's process, stopped if the run ends before it (-g: global where sourced
# in a function)
declare -gA _LANE_PID
_AWAITED=()

# leg NAME COMMAND...: runs one leg and records how long it took and the CPU time its
# processes used. The command runs in a subshell under the caller's `set -e` (not in an `||`
# list, which would switch it off inside): a failing step stops the run, and the table printed
# on exit names the leg.
leg() {
    _LEG_RUNNING="$1 $SECONDS"
    printf '\n=== %s: %s\n' "$1" "${*:2}"
    mkdir -p "$_LEG_LOGS"
    ("${@:2}"; _children_cpu >"$_LEG_LOGS/$1.cpu")
    _leg_row ok "$(cat "$_LEG_LOGS/$1.cpu")"
}

# beside NAME COMMAND...: starts a leg that runs beside the legs after it: for legs that keep
# about one core busy (pip's downloads and unpacking, tutorials one after another, sphinx),
# so that the foreground's legs have the other. Legs started with `beside` run one after
# another in the order given (one lane; after a failure the rest of the lane does not run).
# Their output goes to $_LEG_LOGS/NAME.log, printed by `await NAME`.
beside() {
    local name=$1 after=$_LANE_LAST
    _LANE_LAST=$name
    mkdir -p "$_LEG_LOGS"
    rm -f "$_LEG_LOGS/$name.status"
    set -m  # its own process group where it can: a run that fails stops the whole lane
    (
        trap - EXIT
        set +e
        if [ -n "$after" ]; then
            until [ -e "$_LEG_LOGS/$after.status" ]; do sleep 1; done
            read -r status _ <"$_LEG_LOGS/$after.status"
            if [ "$status" != 0 ]; then
                echo "not run: $after, before it in the lane, failed" >"$_LEG_LOGS/$name.log"
                echo "skipped 0 0" >"$_LEG_LOGS/$name.status"
                exit 0
            fi
        fi
        start=$SECONDS
        (set -e; "${@:2}") >"$_LEG_LOGS/$name.log" 2>&1
        status=$?
        _children_cpu >"$_LEG_LOGS/$name.cpu"
        echo "$status $((SECONDS - start)) $(cat "$_LEG_LOGS/$name.cpu")" \
            >"$_LEG_LOGS/$name.status.part"
        mv "$_LEG_LOGS/$name.status.part" "$_LEG_LOGS/$name.status"
    ) &
    _LANE_PID[$name]=$!
    set +m
    printf '\n=== %s (beside the legs below): %s\n' "$name" "${*:2}"
}

# await NAME...: waits for those `beside` legs, prints their output, records their rows;
# fails if one of them failed.
await() {
    local name status seconds cpu failed=()
    for name in "$@"; do
        until [ -e "$_LEG_LOGS/$name.status" ]; do
            # A lane killed from outside (out of memory, say) never writes its status.
            if ! kill -0 "${_LANE_PID[$name]}" 2>/dev/null && [ ! -e "$_LEG_LOGS/$name.status" ]
            then
                echo "died 0 -" >"$_LEG_LOGS/$name.status"
            fi
            sleep 1
        done
        read -r status seconds cpu <"$_LEG_LOGS/$name.status"
        printf '\n=== %s (ran beside the legs above): %s s\n' "$name" "$seconds"
        cat "$_LEG_LOGS/$name.log"
        _AWAITED+=("$name")
        case $status in
            0) _LEG_ROWS+=("$(_row "$name" "$seconds" "$cpu" "ok (beside)")") ;;
            skipped) _LEG_ROWS+=("$(_row "$name" 0 0 "not run (beside)")"); failed+=("$name") ;;
            *) _LEG_ROWS+=("$(_row "$name" "$seconds" "$cpu" "FAILED ($status, beside)")")
               failed+=("$name") ;;
        esac
    done
    [ ${#failed[@]} = 0 ] || { echo "await: ${failed[*]} failed" >&2; return 1; }
}

# _children_cpu: prints the CPU seconds (user + system) of the processes this shell started
# that have ended (Linux's /proc; "-" elsewhere). Call it with a redirection, not in $(...):
# that subshell would count only its own children.
_children_cpu() {
    local stat fields
    if [ -r "/proc/$BASHPID/stat" ]; then
        read -r stat <"/proc/$BASHPID/stat"
        read -r -a fields <<<"${stat##*) }"  # after "(comm)": fields 3, 4, ...
        echo $(((fields[13] + fields[14]) / $(getconf CLK_TCK)))  # cutime + cstime
    else
        echo -
    fi
}

# _stop_tree PID: kills a process and everything it started: each is stopped first, parent
# before children (so none starts another or is handed to init unseen), then all are
# killed (gloo's processes outlive a TERM). Its process group too, where `set -m` made one
# (a shell without a terminal may not: the tree is what is sure).
_stop_tree() {
    local found=() queue=("$1") pid child
    while [ ${#queue[@]} -gt 0 ]; do
        pid=${queue[0]}
        queue=("${queue[@]:1}")
        kill -STOP "$pid" 2>/dev/null || continue
        found+=("$pid")
        for child in $(ps -o pid= --ppid "$pid" 2>/dev/null); do queue+=("$child"); done
    done
    [ ${#found[@]} = 0 ] || kill -KILL "${found[@]}" 2>/dev/null || true
    kill -KILL -- "-$1" 2>/dev/null || true
}

_row() {  # NAME SECONDS CPU RESULT
    local seconds=$2
    [[ $seconds =~ ^[0-9]+$ ]] && seconds+=s
    printf '%-10s %7s %6s  %s' "$1" "$seconds" "$3" "$4"
}

_leg_row() {
    local name=${_LEG_RUNNING% *} start=${_LEG_RUNNING#* }
    _LEG_ROWS+=("$(_row "$name" $((SECONDS - start)) "${2:--}" "$1")")
    _LEG_RUNNING=""
}

_print_legs() {
    local status=$? pid name total_cpu=0 row
    [ -z "$_LEG_RUNNING" ] || _leg_row "FAILED ($status)"
    for pid in "${_LANE_PID[@]}"; do  # a lane still running when the run ends
        _stop_tree "$pid"
    done
    for name in "${!_LANE_PID[@]}"; do
        [[ " ${_AWAITED[*]} " == *" $name "* ]] && continue
        printf '\n=== %s (beside, not awaited): the end of its output\n' "$name"
        tail -n 40 "$_LEG_LOGS/$name.log" 2>/dev/null || echo "(it printed nothing)"
        _LEG_ROWS+=("$(_row "$name" - - "stopped (beside)")")
    done
    printf '\n%-10s %7s %6s  %s\n' leg seconds cpu-s result
    for row in "${_LEG_ROWS[@]}"; do
        printf '%s\n' "$row"
        read -r _ _ cpu _ <<<"$row"
        [[ $cpu =~ ^[0-9]+$ ]] && total_cpu=$((total_cpu + cpu))
    done
    printf '%-10s %6ds %6s  %s\n' total $((SECONDS - _LEG_STARTED)) "$total_cpu" \
        "$([ $status = 0 ] && echo ok || echo FAILED)"
}
trap _print_legs EXIT

# python_for 3.X: an interpreter of that version that runs: on PATH, else pyenv's (a pyenv
# shim on PATH answers only for the versions pyenv has selected), else one that
# tools/get-python made, or makes now (from Debian's archive, about 20 s, kept for later).
python_for() {
    local found
    for found in "$(command -v "python$1" 2>/dev/null)" \
            $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$1".*/bin/"python$1" 2>/dev/null |
              sort -V -r); do
        if [ -n "$found" ] && "$found" -c "" 2>/dev/null; then
            echo "$found"
            return 0
        fi
    done
    found=$(bash "$(dirname "${BASH_SOURCE[0]}")/../tools/get-python" "$1" | tail -n 1) &&
        [ -n "$found" ] && echo "$found" && return 0
    echo "no Python $1 found, and tools/get-python could not make one" >&2
    return 1
}

# The README's set-up commands, word for word (tests/test_readme.py holds README.md to them).
README_QUICKSTART='python3 -m venv .venv && .venv/bin/pip install . && .venv/bin/python tutorials/01_quickstart.py'
README_TESTS='python3 -m venv .venv && .venv/bin/pip install ".[test]" && .venv/bin/pytest'

# readme_leg [3.X]: the README's test command as a reader runs it in the checkout, built from
# source by pip: with the default python3 into .venv, or with Python 3.X into
# .venv-readme3X (the same command with that interpreter and folder). Then the quickstart
# tutorial from the checkout's root, as the README runs it, in the same environment.
readme_leg() {
    local command=$README_TESTS venv=.venv python
    if [ $# -gt 0 ]; then
        python=$(python_for "$1")
        venv=".venv-readme${1/./}"
        command=${command//.venv/$venv}
        command=${command/python3 /$python }
    fi
    echo "$command"
    bash -c "$command"
    "$venv/bin/python" tutorials/01_quickstart.py >/dev/null
}

# slow_leg 3.X: the tests the README's command leaves out as slow (`pytest -m slow`: the
# benchmarks' smoke runs, the tutorials' checks, the stress tests, jobs of processes that
# fail, the ecosystem's libraries), in wheel_leg 3.X's environment with the test extra added. Then
# the modules that compare with jax-finufft and JAXbind: neither README leg's Python (3.10,
# 3.15) installs them, so there those comparisons skip. Last, jax-finufft's own tests and a
# library's built on it, on contrib.finufft (tools/run-downstream).
slow_leg() {
    local venv=".venv-cp${1/./}"
    "$venv/bin/pip" install -q "$(wheel_for "$1")[test]"
    # (every tutorial runs in the docs leg, with its extras, and in the tutorials leg after a
    # plain install of the newest Python's wheel: not a third time here)
    in_tests "$venv" -q -m slow --deselect tests/test_tutorials.py::test_tutorial_runs
    in_tests "$venv" -q test_contrib_finufft.py test_contrib_finufft_surface.py \
        test_docs.py -k "jax_finufft or surface or jaxbind"
    bash tools/run-downstream "$venv"
}

# wheel_for 3.X: the manylinux wheel tools/build-dist left in dist/ for that Python.
wheel_for() {
    ls dist/jaxdecl-*-cp"${1/./}"-cp"${1/./}"-manylinux*.whl
}

# in_tests VENV PYTEST-ARGS...: the tests run from tests/, outside the checkout, so that
# the installed package is what they test (pyproject.toml's options apply).
in_tests() {
    (cd tests && "../$1/bin/pytest" -p no:cacheprovider --rootdir=.. -c ../pyproject.toml \
        "${@:2}")
}

# What the core modules' tests import beyond jax (the test extra's core).
CORE_TEST_DEPS=("pytest>=7" "pytest-xdist>=3.5" "hypothesis>=6.100" "equinox>=0.11"
                "scipy>=1.11" "flatbuffers>=23")

# wheel_leg 3.X [-- jax=VERSION PYTEST-ARGS... [-- jax=VERSION PYTEST-ARGS...]...]
# The wheel for 3.X in a fresh environment where no compiler can run (none on PATH, CC
# and CXX fail), with only binary packages and the newest JAX this Python gets: the
# quickstart (from the checkout's root, as the README runs it) and the dispatch tests.
# Then, in the same environment with the compiler back (C kernels' tests compile), each
# group after a `--`: JAX V installed with the core modules' test dependencies, and
# pytest ARGS.
wheel_leg() {
    local version=$1 venv=".venv-cp${1/./}" wheel python
    python=$(python_for "$version")
    wheel=$(wheel_for "$version")
    shift
    [ $# = 0 ] || shift  # the first --
    "$python" -m venv "$venv"
    (
        export CC=/bin/false CXX=/bin/false PATH="$PWD/$venv/bin"
        python -c "import shutil, sys; found = [c for c in ('cc', 'c++', 'gcc', 'g++', 'clang')
if shutil.which(c)]; sys.exit(f'a compiler is on PATH: {found}' if found else None)"
        pip install -q --only-binary=:all: "$wheel" "pytest>=7" "pytest-xdist>=3.5"
        python -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__)"
        python tutorials/01_quickstart.py >/dev/null
        in_tests "$venv" -q test_dispatch.py
    )
    while [ $# -gt 0 ]; do
        local group=()
        while [ $# -gt 0 ] && [ "$1" != -- ]; do group+=("$1"); shift; done
        [ $# -gt 0 ] && shift
        local jax=${group[0]#jax=}
        "$venv/bin/pip" install -q "jax==$jax" "jaxlib==$jax" "${CORE_TEST_DEPS[@]}"
        "$venv/bin/python" -c "import jax; print('jax', jax.__version__)"
        in_tests "$venv" -q "${group[@]:1}"
    done
}

# The documentation, in strict mode: a warning, a broken cross-reference or link, or a
# failing tutorial (the build runs them all, each with its extra installed) fails. The
# registry's default PyTorch is the CUDA build (about 2.5 GB); the CPU build satisfies
# the torch extra and is preferred where pip finds it.
docs_leg() {
    local python wheel
    python=$(python_for 3.11)
    wheel=$(wheel_for 3.11)
    "$python" -m venv .venv-docs
    .venv-docs/bin/pip install -q "$wheel[docs,torch]" "torch==2.13.0+cpu" ||
        .venv-docs/bin/pip install -q "$wheel[docs,torch]"
    .venv-docs/bin/sphinx-build -q -W --keep-going -n -b html docs docs/_build/html
}
