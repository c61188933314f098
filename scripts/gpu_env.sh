# Sourced from the repository root by scripts/gpu_check.sh and scripts/gpu_run.sh on a GPU host
# with no network: where tilelang is not importable, the offline bundle in "$bundle"
# (scripts/make_gpu_bundle.sh: site-py312-tilelang0.1.15.tar.xz, fla_core-0.6.0-py3-none-any.whl)
# is unpacked once per machine into $SITE (default /tmp/flash_gdn_site) and put on PYTHONPATH,
# then the repository itself.
site=${SITE:-/tmp/flash_gdn_site}
if ! python3 -c "import tilelang" 2>/dev/null; then
  if [ ! -d "$site/tilelang" ]; then
    mkdir -p "$site" && tar xJf "$bundle"/site-py312-tilelang*.tar.xz -C "$site" \
      && python3 -m pip install -q --no-index --no-deps --target "$site/fla" "$bundle"/fla_core-*.whl || return 1
  fi
  export PYTHONPATH="$site:$site/fla:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" FLA_FLASH_QLA=0 PYTHONUNBUFFERED=1
