#!/usr/bin/env bash
# `cmake --install` into a fresh prefix, then the installed ringlm, run from another directory,
# must find its plugin in <prefix>/lib/ringlm and run the model.
#   check_install.sh BUILD_DIR PREFIX MODEL
set -euo pipefail
build="$1" prefix="$2" model="$3"
rm -rf "$prefix"
cmake --install "$build" --prefix "$prefix" >/dev/null
test -x "$prefix/bin/ringlm" || { echo "FAIL: no $prefix/bin/ringlm"; exit 1; }
test -f "$prefix/lib/ringlm/libringlm-opencl.so" || { echo "FAIL: no plugin in $prefix/lib/ringlm"; exit 1; }
cd /
# Only the installed copy of the plugin may be found: no plugin path from the environment.
devices="$(env -u RINGLM_PLUGIN_PATH "$prefix/bin/ringlm" devices 2>&1)"
echo "$devices"
grep -q "opencl:0 .*\[$prefix/bin/../lib/ringlm/libringlm-opencl.so\]" <<<"$devices" ||
  { echo "FAIL: the installed ringlm does not list the installed plugin"; exit 1; }
text="$("$prefix/bin/ringlm" run -m "$model" -p "The capital of France is" -n 8 --temp 0 -t 1 2>/dev/null)"
echo "run: $text"
grep -q "Paris" <<<"$text" || { echo "FAIL: the installed ringlm did not answer"; exit 1; }
# The installed server, started from / as a service manager would start it.
log="$(mktemp)"
"$prefix/bin/ringlm" serve -m "$model" --port 0 -t 1 2>"$log" &
server=$!
trap 'kill $server 2>/dev/null || true; rm -f "$log"' EXIT
for _ in $(seq 600); do
  port="$(sed -n 's|.*listening on http://127.0.0.1:\([0-9]*\).*|\1|p' "$log")"
  [ -n "$port" ] && [ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$port/health")" = 200 ] && break
  sleep 0.1
done
answer="$(curl -s "http://127.0.0.1:$port/v1/completions" -d '{"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}')"
echo "serve: $answer"
grep -q "Paris" <<<"$answer" || { echo "FAIL: the installed server did not answer"; cat "$log"; exit 1; }
kill -TERM $server
wait $server || { echo "FAIL: the installed server did not exit 0 on SIGTERM"; cat "$log"; exit 1; }
echo PASS
