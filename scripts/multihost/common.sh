# shellcheck shell=bash
# Helpers sourced by the multi-host launchers (scripts/tpu/*.sh, scripts/gpu/*.sh); not run by itself.
#   run CMD...     prints CMD (shell-quoted, copy-pasteable) and runs it; with DRY_RUN=1 only prints it, on stdout
#   note TEXT      a line for the reader: on stdout as "# TEXT" in a dry run, on stderr otherwise
#   shq ARG...     the arguments shell-quoted, joined by spaces
#   die TEXT       the message on stderr, exit 2
DRY_RUN="${DRY_RUN:-0}"
SCRIPT_NAME="${SCRIPT_NAME:-$(basename "$0")}"

die() {
  printf '%s: %s\n' "$SCRIPT_NAME" "$*" >&2
  exit 2
}

shq() {
  local out="" arg
  for arg in "$@"; do
    if [[ "$arg" =~ ^[A-Za-z0-9_./:=,@+%-]+$ ]]; then
      out+="$arg "
    else
      out+="'${arg//\'/\'\\\'\'}' "
    fi
  done
  printf '%s' "${out% }"
}

run() {
  if [ "$DRY_RUN" = 1 ]; then
    printf '%s\n' "$(shq "$@")"
  else
    printf '+ %s\n' "$(shq "$@")" >&2
    "$@"
  fi
}

note() {
  if [ "$DRY_RUN" = 1 ]; then
    printf '# %s\n' "$*"
  else
    printf '%s: %s\n' "$SCRIPT_NAME" "$*" >&2
  fi
}

# need_value OPTION VALUE: VALUE is present (the option takes one)
need_value() {
  [ "$#" -ge 2 ] && [ -n "$2" ] || die "$1 needs a value"
}

# env_prefix K=V...: "env K=V ..." (shell-quoted) for a remote command, or nothing
env_prefix() {
  [ "$#" -eq 0 ] && return 0
  local kv
  for kv in "$@"; do
    [[ "$kv" =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] || die "--env $kv: expected NAME=VALUE"
  done
  printf 'env %s ' "$(shq "$@")"
}
