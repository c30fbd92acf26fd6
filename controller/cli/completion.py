"""`autolab completion bash|zsh`: a shell completion script written from the parser itself.

The script knows every command, subcommand, option and option choice that `build_parser()`
declares, so it cannot drift from the CLI. Options that take a path complete file names;
commands that take an experiment's name ask the lab (`autolab get -o name`, quietly) for
the names it knows. zsh runs the same script through its bash compatibility layer.

    source <(autolab completion bash)          # this shell
    autolab completion bash > ~/.local/share/bash-completion/completions/autolab
"""

from __future__ import annotations

import argparse
import shlex
import sys

PATH_OPTIONS = {"-f", "--filename", "--lab", "--dir", "--out", "--from", "--source",
                "--lab-dir", "-o"}  # -o: only where it takes a FILE (see _takes_path)
NAME_COMMANDS = {"get", "describe", "logs", "delete"}


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _takes_path(action: argparse.Action) -> bool:
    if action.choices or action.nargs == 0:
        return False
    if action.metavar in ("FILE", "DIR", "SEED_DIR"):
        return True
    return any(o in PATH_OPTIONS and o != "-o" for o in action.option_strings)


def _describe(parser: argparse.ArgumentParser) -> tuple[list[str], dict[str, str], list[str]]:
    """Options, {option: words to offer after it} ('' = files), positional choices."""
    options: list[str] = []
    after: dict[str, str] = {}
    positional: list[str] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            continue
        if action.option_strings:
            if action.help == argparse.SUPPRESS:
                continue
            options += action.option_strings
            if action.choices:
                for o in action.option_strings:
                    after[o] = " ".join(map(str, action.choices))
            elif _takes_path(action):
                for o in action.option_strings:
                    after[o] = ""
        elif action.choices:
            positional += [str(c) for c in action.choices]
    return options, after, positional


def _case_body(key: str, parser: argparse.ArgumentParser, indent: str) -> list[str]:
    options, after, positional = _describe(parser)
    lines = [f"{indent}{shlex.quote(key)})"]
    if after:
        lines.append(f'{indent}  case "$prev" in')
        for opt, words in after.items():
            action = f'COMPREPLY=($(compgen -W {shlex.quote(words)} -- "$cur"))' if words \
                else 'COMPREPLY=($(compgen -f -- "$cur"))'
            lines.append(f"{indent}    {opt}) {action}; return ;;")
        lines.append(f"{indent}  esac")
    lines.append(f"{indent}  opts={shlex.quote(' '.join(options))}")
    lines.append(f"{indent}  words={shlex.quote(' '.join(positional))}")
    lines.append(f"{indent}  ;;")
    return lines


def bash_script(parser: argparse.ArgumentParser) -> str:
    prog = parser.prog
    commands = _subparsers(parser)
    top_options = [o for a in parser._actions if not isinstance(a, argparse._SubParsersAction)
                   for o in a.option_strings]
    lines = [
        f"# bash completion for {prog}, written by `{prog} completion bash`",
        f"_{prog}_complete() {{",
        '  local cur="${COMP_WORDS[COMP_CWORD]}" prev="${COMP_WORDS[COMP_CWORD-1]}"',
        '  local cmd="" sub="" i opts="" words=""',
        "  for ((i = 1; i < COMP_CWORD; i++)); do",
        '    case "${COMP_WORDS[i]}" in -*) continue ;; esac',
        '    if [ -z "$cmd" ]; then cmd="${COMP_WORDS[i]}"; elif [ -z "$sub" ]; then '
        'sub="${COMP_WORDS[i]}"; fi',
        "  done",
        '  if [ -z "$cmd" ]; then',
        f'    COMPREPLY=($(compgen -W {shlex.quote(" ".join([*commands, *top_options]))} '
        '-- "$cur"))',
        "    return",
        "  fi",
        '  case "$cmd" in',
    ]
    for name, sp in commands.items():
        nested = _subparsers(sp)
        if nested:
            lines.append(f"    {shlex.quote(name)})")
            lines.append('      case "$sub" in')
            for sub_name, ssp in nested.items():
                lines += _case_body(sub_name, ssp, "        ")
            lines.append(f"        *) opts={shlex.quote(' '.join(_describe(sp)[0]))}; "
                         f"words={shlex.quote(' '.join(nested))} ;;")
            lines.append("      esac")
            lines.append("      ;;")
        else:
            lines += _case_body(name, sp, "    ")
    names = "|".join(sorted(NAME_COMMANDS & set(commands)))
    lines += [
        "  esac",
        '  if [[ "$cur" == -* ]]; then',
        '    COMPREPLY=($(compgen -W "$opts" -- "$cur"))',
        "    return",
        "  fi",
        '  case "$cmd" in',
        f"    {names})",
        f'      words="$words $({prog} get -o name 2>/dev/null | sed "s|^.*/||")" ;;',
        "  esac",
        '  COMPREPLY=($(compgen -W "$words" -- "$cur"))',
        "}",
        f"complete -o default -F _{prog}_complete {prog}",
        "",
    ]
    return "\n".join(lines)


def zsh_script(parser: argparse.ArgumentParser) -> str:
    return ("# zsh completion for autolab, through zsh's bash completion layer\n"
            "autoload -U +X compinit && compinit\n"
            "autoload -U +X bashcompinit && bashcompinit\n" + bash_script(parser))


def cmd_completion(a, parser: argparse.ArgumentParser) -> int:
    sys.stdout.write(bash_script(parser) if a.shell == "bash" else zsh_script(parser))
    return 0
