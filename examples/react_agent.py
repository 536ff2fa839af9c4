"""A ReAct-style agent: the model thinks, picks a tool with `select`, writes the tool's input
with `gen`, and Python runs the tool and feeds the observation back into the prompt.

    python examples/react_agent.py [--url URL]
"""

import argparse
import ast
import operator

import radixlm as sgl

FACTS = {"eiffel tower height": "330", "great wall length": "21196", "mount everest height": "8849"}
TOOLS = ["calculator", "lookup", "finish"]

FEW_SHOT = """Answer questions using tools: calculator[expression], lookup[topic], finish[answer].

Question: How much taller is Mount Everest than 8000 meters?
Thought: I need the height of Mount Everest.
Action: lookup[mount everest height]
Observation: 8849
Thought: Now I subtract 8000 from 8849.
Action: calculator[8849 - 8000]
Observation: 849
Thought: I know the answer.
Action: finish[849]

Question: What is twice the length of the Great Wall?
Thought: I need the length of the Great Wall.
Action: lookup[great wall length]
Observation: 21196
Thought: Now I multiply 21196 by 2.
Action: calculator[21196 * 2]
Observation: 42392
Thought: I know the answer.
Action: finish[42392]

"""

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculator(expression: str) -> str:
    """Evaluates + - * / on numbers, and nothing else."""
    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        raise ValueError("only numbers and + - * /")
    try:
        result = value(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as e:
        return f"error: {e}"
    return str(int(result) if float(result).is_integer() else round(result, 4))


def lookup(topic: str) -> str:
    """The fact whose name shares the most words with the topic (a small model paraphrases)."""
    words = set(topic.lower().split())
    best = max(FACTS, key=lambda name: len(words & set(name.split())))
    return FACTS[best] if words & set(best.split()) else "unknown"


@sgl.function
def react(s, question, max_steps=4):
    s += FEW_SHOT + f"Question: {question}\n"
    for step in range(max_steps):
        s += "Thought:" + sgl.gen(f"thought_{step}", max_tokens=24, stop="\n") + "\n"
        s += "Action: " + sgl.select(f"tool_{step}", TOOLS) + "["
        s += sgl.gen(f"input_{step}", max_tokens=16, stop=["]", "\n"]) + "]\n"
        tool, tool_input = s[f"tool_{step}"], s[f"input_{step}"]  # read back to run the tool in Python
        if tool == "finish":
            s["answer"] = tool_input.strip()
            return
        observation = calculator(tool_input) if tool == "calculator" else lookup(tool_input)
        s += f"Observation: {observation}\n"
    s["answer"] = None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running radixlm server (default: start one)")
    args = parser.parse_args()
    backend = sgl.RuntimeEndpoint(args.url) if args.url else sgl.Runtime()
    try:
        state = react.run("What is twice the height of the Eiffel Tower?", backend=backend, temperature=0)
        print(state.text())
        print("answer:", state["answer"])
    finally:
        if isinstance(backend, sgl.Runtime):
            backend.shutdown()


if __name__ == "__main__":
    main()
