"""Writes the text the project trains its own small tiktoken vocabulary on.

Everything here is written for this project (no external corpus): English prose
and templated sentences, C and Python code, Chinese (Han), Japanese (kana mixed
with Han, so the `&&[^\\p{Han}]` class intersection of the K3 pattern matters),
Korean, Cyrillic, Greek, Latin with accents (precomposed and with combining
marks), emoji (ZWJ sequences, skin tones, flags), digit runs, whitespace runs,
tabs and CRLF line ends. The text is a pure function of the seed: a tiny
SplitMix64 drives every choice, so the corpus does not depend on Python's
`random` module.
"""

M64 = (1 << 64) - 1


class Mix:
    """SplitMix64: deterministic, version-independent choices."""

    def __init__(self, seed):
        self.s = seed & M64

    def next(self):
        self.s = (self.s + 0x9E3779B97F4A7C15) & M64
        z = self.s
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
        return z ^ (z >> 31)

    def below(self, n):
        return self.next() % n

    def pick(self, seq):
        return seq[self.below(len(seq))]


PROSE = [
    "The quick brown fox jumps over the lazy dog while the river keeps running toward the sea.",
    "A shoal of small fish turns at once, and nobody can say which fish decided first.",
    "It's not the size of the model that matters; it's whether the numbers match the reference.",
    "We'll test every path twice: once the slow way, once the fast way, and they'd better agree.",
    "They've measured the bandwidth, and I'm sure you're going to ask what the bound is.",
    "Don't trust a benchmark that doesn't say which machine, which commit and how many threads.",
    "THE ROUTER PICKS SIXTEEN EXPERTS; THE NORM RUNS AFTER THE FULL SUM, NOT BEFORE IT.",
    "McDonald's O'Neill DeVries MacArthur iPhone eBay JavaScript TypeScript PostgreSQL",
    "Attention residuals mix a handful of saved block inputs with a softmax over their scores.",
    "The delta rule subtracts what the state already predicts before it writes the new value.",
    "Mixture-of-experts layers send each token to a few experts and add their weighted outputs.",
    "Checkpoints are split into shards; an index file maps every tensor name to its shard.",
    "Greedy decoding always takes the most likely token, so two correct engines must agree.",
    "Temperature 0.7, top-p 0.95, top-k 40: sampling settings that people like to argue about.",
    "In 1969, 600 million people watched; by 2024 the count was closer to 8,100,000,000 people.",
    "Version 3.14.159 shipped on 2026-11-30 at 08:35:51 UTC with 12,345 tests and 0 failures.",
]

WORDS = (
    "time person year way day thing man world life hand part child eye woman place work "
    "week case point government company number group problem fact tensor shard expert router "
    "token layer kernel socket worker server client buffer cache state vector matrix value "
    "scale block head channel gate norm weight bias logit sample seed thread queue frame "
    "quickly slowly carefully exactly almost never always often rarely together apart "
    "compute measure verify load store read write send receive merge split route mix"
).split()

NAMES = ["Alice", "Bob", "Carol", "Dmitri", "Eve", "François", "Günther", "Håkon", "Işıl", "José",
         "Łukasz", "Zoë", "Nguyễn", "Søren", "Ærøskøbing", "Ñandú"]

CODE = [
    "static int shoal_st_open(shoal_st **out, const char *path, char *err, size_t errlen)\n{\n"
    "    if (!out || !path)\n        return SHOAL_EINVAL;\n    *out = NULL;\n    return 0;\n}\n",
    "for (int i = 0; i < n; i++) {\n\tacc += w[i] * x[i];\n\tif (acc > 1e30f) break;\n}\n",
    "def rms_norm(x, w, eps=1e-5):\n    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))\n",
    "class Router:\n    def __init__(self, n_experts: int, top_k: int) -> None:\n"
    "        self.n_experts = n_experts\n        self.top_k = top_k\n",
    "#include <stdint.h>\n#include <string.h>\n\n#define SHOAL_MAX_LAYERS 256\n",
    "x = [1, 2, 3]; y = {'a': 1, \"b\": 2.5}; z = (x, y) if len(x) >= 3 else None  # noqa\n",
    "if (rc < 0 && errno == EINTR) { continue; } else if (rc == 0) { return -ETIMEDOUT; }\n",
    "    uint16_t h = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);\n",
    "SELECT id, name FROM experts WHERE layer = 42 AND load > 0.75 ORDER BY load DESC;\n",
    "<html><body><p class=\"note\">Hello &amp; welcome</p></body></html>\n",
    "{\"model_type\": \"kimi_k3\", \"hidden_size\": 7168, \"num_experts\": 896, \"ok\": true}\n",
]

HAN = [
    "这是一个用于测试分词器的中文句子。",
    "专家混合模型把每个词元送到少数几个专家那里。",
    "注意力残差在几个保存的块输入之间做加权混合。",
    "今天天气很好，我们去公园散步，然后回家写代码。",
    "机器学习需要大量的数据和计算资源，但小模型也能测试正确性。",
    "數據中心的服務器之間通過網絡交換激活值。",
    "北京、上海、广州和深圳都是很大的城市。",
    "读书破万卷，下笔如有神。",
]

JAPANESE = [
    "これはトークナイザーのテストです。漢字とひらがなとカタカナが混ざっています。",
    "東京駅で新幹線に乗って、大阪まで行きました。",
    "エキスパートの出力は重み付きで足し合わされます。",
    "ｶﾀｶﾅ半角とＡＢＣ全角も少しだけ入れておきます。",
]

KOREAN = ["한국어 문장도 조금 넣어 둡니다. 토크나이저가 잘 나누는지 봅시다.", "서울은 대한민국의 수도입니다."]
CYRILLIC = ["Быстрая коричневая лиса прыгает через ленивую собаку.", "Привет, мир! Это тест токенизатора."]
GREEK = ["Η γρήγορη καφέ αλεπού πηδά πάνω από τον τεμπέλη σκύλο.", "Καλημέρα κόσμε."]
ACCENTS = [
    "Café, naïve, façade, jalapeño, crème brûlée, déjà vu, über, Straße, Ærø, smørrebrød.",
    "Tiếng Việt có rất nhiều dấu: ắ ằ ẳ ẵ ặ ấ ầ ẩ ẫ ậ ế ề ể ễ ệ.",
    "Cafe\u0301 with a combining acute, n\u0303 with a combining tilde, a\u0308 and o\u0308.",
    "Ça va? Où est la gare? ¿Dónde está la estación? ¡Qué bien!",
    "Zażółć gęślą jaźń. Příliš žluťoučký kůň úpěl ďábelské ódy.",
]
EMOJI = [
    "👍 👍🏻 👍🏽 👍🏿 ❤️ 🔥 🎉 🦉 🐟🐟🐟",
    "👩‍💻 👨‍👩‍👧‍👦 🏳️‍🌈 🧑🏾‍🚀 👩🏼‍🔬",
    "🇫🇷 🇯🇵 🇧🇷 🇨🇳 ✅ ❌ ⚠️ ☕ ♻️",
    "emoji😀in😀words and digits1️⃣2️⃣3️⃣",
]
WHITESPACE = [
    "\n\n\n", "    ", "\t\t", "\r\n", "  \r\n  ", "        indented line\n", " \u00a0non-breaking\u00a0space ",
    "\u3000全角空格\u3000", "a  b   c    d     e\n",
]


SYL_C = ["b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z",
         "ch", "sh", "th", "st", "tr", "pl", "gr", "qu"]
SYL_V = ["a", "e", "i", "o", "u", "ai", "ou", "ea", "io", "é", "ü", "ø"]
HAN_POOL = "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年得就那要下以生会自着去之过家学对可里后小么心多天而能好都然没日于起还发成事只作当想看文无开手十用主行方又如前所本见经头面公同三已老从动两长知民样现分将外但身些与高意进把法此实回二理美点月明其种声全工己话儿者向情部正名定女问力机给等几很业最间新什打便位因重被走电四第门相次东政海口使教西再平真听世气信北少关并内加化由却代军产入先山五太水万市眼体别处总才场师书比住员九笑性通目华报立马命张活难神数件安表原车白应路期叫死常提感金何更反合放做系计或司利受光王果亲界及今京务制解各任至清物台象记边共风战干接它许八特觉望直服毛林题建南度统色字请交爱让认算论百吃义科怎元社术结六功指思非流每青管夫连远资队跑"


def pseudo_word(m):
    n = 1 + m.below(4)
    w = "".join(m.pick(SYL_C) + m.pick(SYL_V) for _ in range(n))
    k = m.below(8)
    if k == 0:
        w = w.capitalize()
    elif k == 1:
        w = w.upper()
    elif k == 2:
        w = w + m.pick(["'s", "'t", "'re", "'ll", "'D", "'VE"])
    return w


def han_run(m):
    return "".join(m.pick(HAN_POOL) for _ in range(1 + m.below(6)))


def sentence(m):
    n = 4 + m.below(9)
    ws = [m.pick(WORDS) for _ in range(n)]
    if m.below(3) == 0:
        ws.insert(m.below(len(ws)), m.pick(NAMES))
    s = " ".join(ws)
    s = s[0].upper() + s[1:]
    return s + m.pick([".", ".", "!", "?", "...", ";"])


def number(m):
    k = m.below(6)
    if k == 0:
        return str(m.below(10))
    if k == 1:
        return str(m.below(1000000))
    if k == 2:
        return f"{m.below(10000)}.{m.below(1000):03d}"
    if k == 3:
        return f"{1990 + m.below(40)}-{1 + m.below(12):02d}-{1 + m.below(28):02d}"
    if k == 4:
        return "".join(str(m.below(10)) for _ in range(5 + m.below(20)))
    return f"0x{m.next() & 0xFFFFFFFF:08X}"


def corpus(seed=1, paragraphs=2600):
    m = Mix(seed)
    out = []
    pools = [PROSE, CODE, HAN, JAPANESE, KOREAN, CYRILLIC, GREEK, ACCENTS, EMOJI]
    for _ in range(paragraphs):
        kind = m.below(14)
        if kind < 3:
            para = " ".join(sentence(m) for _ in range(1 + m.below(4)))
        elif kind < 5:
            para = m.pick(PROSE) + " " + number(m) + " " + sentence(m)
        elif kind < 7:
            para = m.pick(m.pick(pools))
        elif kind == 7:
            para = m.pick(HAN) + m.pick(HAN) + number(m)
        elif kind == 8:
            para = m.pick(CODE)
        elif kind == 9:
            para = " ".join(number(m) for _ in range(1 + m.below(6)))
        elif kind == 10:
            para = m.pick(ACCENTS) + " " + m.pick(EMOJI)
        elif kind == 11:
            para = sentence(m) + m.pick(WHITESPACE) + m.pick(JAPANESE)
        elif kind == 12:
            para = " ".join(pseudo_word(m) for _ in range(3 + m.below(10))) + m.pick([".", ",", "!", "?"])
        else:
            para = "，".join(han_run(m) for _ in range(2 + m.below(4))) + "。"
        out.append(para)
        out.append(m.pick(["\n", "\n\n", "\r\n", " ", "\n    ", "\t"]))
    return "".join(out)


if __name__ == "__main__":
    import sys
    sys.stdout.write(corpus())
