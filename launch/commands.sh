# shellcheck shell=bash
# Sourced by the launch scripts: print each command as it will run (copy-pastable), then run it
# unless DRY_RUN=1 (the caller sets DRY_RUN).

# One argument as the shell would need it, readable: as is, or in single quotes.
quote() {
  if [[ "$1" =~ ^[A-Za-z0-9_./:=@%+,-]+$ ]]; then
    printf '%s' "$1"
  else
    local sq="'\\''"
    printf "'%s'" "${1//\'/$sq}"
  fi
}

# Print a command, then run it unless DRY_RUN=1.
run() {
  local a line="+"
  for a in "$@"; do line+=" $(quote "$a")"; done
  printf '%s\n' "$line"
  if [ "$DRY_RUN" != 1 ]; then "$@"; fi
}
