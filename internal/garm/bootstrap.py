#!/usr/bin/env python3
# libvirt-executor's garm bootstrap, run once by cloud-init as root on the
# first boot: it does what garm's own providers' user-data does (report
# progress to garm with the instance token, download the runner tool and
# verify its sha256, register the runner with JIT credentials or a
# registration token, start it as a service, report system info and idle,
# or failed). Its parameters (garm's instance token among them) are a file
# of the seed's own filesystem (SEED_PARAMS), not of the user-data:
# cloud-init never reads them, so no copy reaches the guest's disk. The
# host attaches the seed writable with the serial SEED_SERIAL; the
# bootstrap reads the parameters into its memory and at once overwrites
# the whole device with zeros (which reach the host's volume too). The
# token then lives in this process only. Everything that needs it comes
# first (status reports, the runner's registration, system info, idle);
# then cloud-init's copies are scrubbed (defence in depth: they hold no
# token), DONE_MARKER tells the host it may detach the (zeroed) seed, and
# the runner service is started LAST, by exec: this process, the token's
# last copy, is gone before the runner can take a job (the runner user
# has sudo).
import base64
import hashlib
import json
import os
import pwd
import re
import shutil
import ssl
import stat
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request

RUNNER_USER = "runner"
# How long garm (and the download host) may stay unreachable.
REACH_SECONDS = 15 * 60
CA_FILE = "/usr/local/share/ca-certificates/garm-ca-bundle.crt"
# The root of the filesystem the scrub works on: "" in the guest; only the
# tests (bootstrap_test.go) set LVE_BOOTSTRAP_ROOT, to a fake root.
ROOT = os.environ.get("LVE_BOOTSTRAP_ROOT", "")
# The last line on the console: the host (garm.SeedDoneMarker) then
# wipes, detaches and deletes the seed.
DONE_MARKER = "lve-garm-bootstrap: done, the seed is no longer needed"
# The writable seed's serial (guestinit.WritableSeedSerial), its label
# and the parameters' name on it (garm.seedParams).
SEED_SERIAL = "lve-seed-rw"
SEED_LABEL = b"cidata"
SEED_PARAMS = "lve-garm.json"
MAX_SEED_BYTES = 64 << 20
SYSTEMD_DIR = "/etc/systemd/system"
# Where cloud-init keeps copies of the user-data (which carries the
# parameters, token included, base64-encoded): its state (user-data.txt,
# user-data.txt.i, cloud-config.txt, obj.pkl, ...) and its run-time data
# (combined-cloud-config.json, instance-data-sensitive.json, ...); and its
# own logs in /var/log (cloud-init*.log only).
SCRUB_TREES = ("/var/lib/cloud", "/run/cloud-init")
SCRUB_LOG_DIR = "/var/log"
MAX_SCRUB_BYTES = 256 << 20


def log(msg):
    print("lve-garm-bootstrap: " + msg, flush=True)


class Garm:
    def __init__(self, cfg):
        self.cfg = cfg
        self.token = cfg["token"]
        cb = cfg["callback_url"].rstrip("/")
        self.status_url = cb if cb.endswith("/status") else cb + "/status"
        self.info_url = self.status_url[: -len("/status")] + "/system-info/"
        self.meta = cfg["metadata_url"].rstrip("/")
        self.deadline = time.monotonic() + REACH_SECONDS
        self.ctx = ssl.create_default_context()
        if cfg.get("ca_bundle"):
            self.ctx.load_verify_locations(CA_FILE)

    def request(self, method, url, body=None, token=None):
        # Retried while garm cannot be reached (the network may come up
        # after this starts) or answers 5xx, until the deadline; a 4xx is
        # final. The token goes as an unredirected header: a redirect to
        # another host does not get it.
        data = None if body is None else json.dumps(body).encode()
        last, delay = None, 1
        while True:
            req = urllib.request.Request(url, data=data, method=method)
            req.add_header("Accept", "application/json")
            if data is not None:
                req.add_header("Content-Type", "application/json")
            if token:
                req.add_unredirected_header("Authorization", "Bearer " + token)
            try:
                with urllib.request.urlopen(req, timeout=30, context=self.ctx) as resp:
                    return resp.read()
            except urllib.error.HTTPError as e:
                if e.code < 500:
                    raise RuntimeError("%s %s: HTTP %d" % (method, url, e.code))
                last = e
            except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
                last = e
            if time.monotonic() + delay > self.deadline:
                raise RuntimeError("%s %s: %s (gave up after %d s)" % (method, url, last, REACH_SECONDS))
            log("%s %s: %s; retrying" % (method, url, last))
            time.sleep(delay)
            delay = min(delay * 2, 10)

    def status(self, status, message, agent_id=None):
        # Best effort, as in garm's own bootstrap: a status garm does not
        # take does not stop the runner's installation.
        body = {"status": status, "message": message}
        if agent_id is not None:
            body["agent_id"] = agent_id
        try:
            self.request("POST", self.status_url, body, self.token)
        except Exception as e:
            log("status %s not reported: %s" % (status, e))

    def metadata(self, path):
        return self.request("GET", self.meta + "/" + path, None, self.token)


def runner_home():
    # The runner user, with passwordless sudo as in garm's own images
    # (workflows expect it).
    try:
        pwd.getpwnam(RUNNER_USER)
    except KeyError:
        subprocess.run(["useradd", "-m", "-s", "/bin/bash", RUNNER_USER], check=True)
    if not os.path.isdir("/etc/sudoers.d"):
        log("no /etc/sudoers.d (no sudo in the image): the runner gets no sudo")
        return pwd.getpwnam(RUNNER_USER).pw_dir
    sudoers = "/etc/sudoers.d/lve-garm-runner"
    with open(sudoers + ".tmp", "w") as f:
        f.write("%s ALL=(ALL) NOPASSWD:ALL\n" % RUNNER_USER)
    os.chmod(sudoers + ".tmp", 0o440)
    os.replace(sudoers + ".tmp", sudoers)
    return pwd.getpwnam(RUNNER_USER).pw_dir


def download(g, tool, dest):
    req = urllib.request.Request(tool["download_url"])
    if tool.get("temp_download_token"):
        # not forwarded to a redirect's host (pre-signed storage URLs)
        req.add_unredirected_header("Authorization", "Bearer " + tool["temp_download_token"])
    h = hashlib.sha256()
    with urllib.request.urlopen(req, timeout=300, context=g.ctx) as resp, open(dest, "wb") as out:
        while True:
            chunk = resp.read(1 << 20)
            if not chunk:
                break
            h.update(chunk)
            out.write(chunk)
    want = (tool.get("sha256_checksum") or "").lower()
    if h.hexdigest() != want:
        raise RuntimeError("runner download %s: sha256 %s, expected %s" % (tool.get("filename"), h.hexdigest(), want))


def as_runner(args, cwd):
    # The arguments may hold a registration token: a failure names only
    # the program, never its arguments (they would go to garm and the log).
    rc = subprocess.run(["runuser", "-u", RUNNER_USER, "--"] + args, cwd=cwd).returncode
    if rc != 0:
        raise RuntimeError("%s exited with %d" % (args[0], rc))


def install_packages(pkgs):
    # Debian package names (checked by the provider), as one argument
    # vector; the package lists first.
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update", "-q"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", "--"] + list(pkgs), check=True, env=env)


def token_patterns(token):
    # The token as it is, and as it appears inside any base64 text that
    # holds it (cloud-init's copies of write_files' b64 content): the
    # base64 of the token's bytes from each of the three offsets that may
    # fall on a 3-byte group boundary, whole groups only.
    t = token.encode()
    pats = [t]
    for k in range(3):
        n = (len(t) - k) // 3 * 3
        if n >= 6:
            pats.append(base64.b64encode(t[k:k + n]))
    return pats


def redact(path, pats):
    # Overwrites every occurrence of pats in the plain file at path, in
    # place and with as many bytes: the file keeps its size and its format
    # (a JSON stays JSON, cloud-init's pickle stays loadable), and the
    # token's bytes are overwritten on the disk, not only unlinked. Links
    # are not followed. True if anything was overwritten.
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_SCRUB_BYTES:
            return False
        data = os.pread(fd, st.st_size, 0)
        hit = False
        for p in pats:
            i = data.find(p)
            while i >= 0:
                os.pwrite(fd, b"x" * len(p), i)
                hit = True
                i = data.find(p, i + len(p))
        if hit:
            os.fsync(fd)
        return hit
    finally:
        os.close(fd)


def scrub(token):
    pats = token_patterns(token)
    paths = []
    for tree in SCRUB_TREES:
        # not into linked directories (/var/lib/cloud/instance links to
        # instances/<id>, which is walked itself)
        for dirpath, _, files in os.walk(ROOT + tree):
            paths += [os.path.join(dirpath, n) for n in files]
    try:
        paths += [os.path.join(ROOT + SCRUB_LOG_DIR, n) for n in os.listdir(ROOT + SCRUB_LOG_DIR) if n.startswith("cloud-init")]
    except OSError:
        pass
    for p in sorted(paths):
        try:
            if redact(p, pats):
                log("token scrubbed from %s" % p[len(ROOT):])
        except OSError:
            pass  # a link, a read-only mount, gone meanwhile


def unmount_seed(seeds):
    # cloud-init mounts the seed only while it reads it; unmount it if it
    # is still mounted (before it is wiped).
    devs = {os.path.realpath(d) for d in seeds}
    for label in ("cidata", "CIDATA"):
        p = os.path.join(ROOT + "/dev/disk/by-label", label)
        if os.path.exists(p):
            devs.add(os.path.realpath(p))
    if not devs:
        return
    try:
        with open(ROOT + "/proc/self/mounts") as f:
            mounts = [line.split() for line in f]
    except OSError:
        return
    for m in mounts:
        if len(m) > 1 and m[0] in devs:
            where = re.sub(r"\\([0-7]{3})", lambda x: chr(int(x.group(1), 8)), m[1])
            subprocess.run(["umount", where], check=False)


def seed_devices():
    # The block devices with the writable seed's serial (sysfs), as paths
    # under /dev.
    base = ROOT + "/sys/class/block"
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return []
    devs = []
    for n in names:
        try:
            with open(os.path.join(base, n, "serial"), "rb") as f:
                serial = f.read(64).strip()
        except OSError:
            continue
        if serial == SEED_SERIAL.encode() and re.fullmatch(r"[a-z0-9]+", n):
            devs.append(ROOT + "/dev/" + n)
    return devs


def read_device(dev):
    fd = os.open(dev, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        size = os.lseek(fd, 0, os.SEEK_END)
        if size > MAX_SEED_BYTES:
            raise RuntimeError("%s: %d bytes, more than a seed" % (dev, size))
        return read_all(fd, size)
    finally:
        os.close(fd)


def read_all(fd, size):
    out = bytearray()
    while len(out) < size:
        b = os.pread(fd, size - len(out), len(out))
        if not b:
            break
        out += b
    return bytes(out)


def iso_file(data, name):
    # The content of the file name at the root of the ISO 9660 image data
    # (its Rock Ridge name, or its ISO name without ";1"), or None: not an
    # ISO labelled SEED_LABEL (a wiped seed is zeros), or no such file.
    def u32(b, o):
        return int.from_bytes(b[o:o + 4], "little")
    pvd = data[16 * 2048:17 * 2048]
    if pvd[:6] != b"\x01CD001" or pvd[40:72].rstrip(b" \0") != SEED_LABEL:
        return None
    root = pvd[156:190]
    d = data[u32(root, 2) * 2048:u32(root, 2) * 2048 + u32(root, 10)]
    want = name.encode()
    i = 0
    while i < len(d):
        n = d[i]
        if n == 0:  # records do not cross a sector: the next one
            i = (i // 2048 + 1) * 2048
            continue
        r = d[i:i + n]
        i += n
        if len(r) < 34 or r[25] & 2:  # short, or a directory
            continue
        nl = r[32]
        names = {r[33:33 + nl].split(b";")[0].rstrip(b".").lower()}
        su, j, nm = r[33 + nl + (1 - nl % 2):], 0, b""
        while j + 4 <= len(su):  # Rock Ridge: NM entries carry the name
            ln = su[j + 2]
            if ln < 4:
                break
            if su[j:j + 2] == b"NM":
                nm += su[j + 5:j + ln]
            j += ln
        if nm:
            names.add(nm)
        if want in names or want.lower() in names:
            ext, size = u32(r, 2), u32(r, 10)
            return data[ext * 2048:ext * 2048 + size]
    return None


def seed_params(devs):
    for dev in devs:
        try:
            raw = iso_file(read_device(dev), SEED_PARAMS)
        except OSError as e:
            log("cannot read the seed %s: %s" % (dev[len(ROOT):], e))
            continue
        if raw is not None:
            return raw
    return None


WIPED = set()


def wipe_seed(dev):
    # Overwrites the whole seed device with zeros, flushes it (the zeros
    # reach the host's volume) and reads it back past the cache. A seed
    # the guest cannot write (attached read-only) is an error: the token
    # would stay there for any root job.
    fd = os.open(dev, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        size = os.lseek(fd, 0, os.SEEK_END)
        if size > MAX_SEED_BYTES:
            raise RuntimeError("%d bytes, more than a seed" % size)
        zeros = bytes(1 << 20)
        off = 0
        while off < size:
            off += os.pwrite(fd, zeros[:min(len(zeros), size - off)], off)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        back = read_all(fd, size)
        if len(back) != size or back.count(0) != size:
            raise RuntimeError("it does not read back as zeros")
    finally:
        os.close(fd)
    WIPED.add(dev)
    log("seed %s wiped (%d bytes)" % (dev[len(ROOT):], size))


def wipe_seeds(devs):
    unmount_seed(devs)
    for dev in devs:
        if dev not in WIPED:
            try:
                wipe_seed(dev)
            except (OSError, RuntimeError) as e:
                raise RuntimeError("cannot wipe the seed %s: %s" % (dev[len(ROOT):], e))


def finish(devs, token):
    # Nothing uses the token any more: the seed is wiped (if it is not
    # already), cloud-init's copies are scrubbed, and the host is told it
    # may detach the seed.
    try:
        wipe_seeds(devs)
    except Exception as e:
        log("%s; the host removes it (garm.seed_keep)" % e)
    if token:
        try:
            scrub(token)
        except Exception as e:
            log("scrub failed: %s" % e)


def start_runner(start):
    # The runner service, last: by exec, so that this process (the
    # token's last copy, in its memory) is gone when the runner starts.
    argv, cwd = start
    log("starting the runner service: %s" % " ".join(argv))
    print(DONE_MARKER, flush=True)
    os.chdir(cwd)
    os.execvpe(argv[0], argv, {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"})


def read_token(raw):
    # the token of a parameter file that may not parse
    m = re.search(rb'"token"\s*:\s*"([^"\\]+)"', raw)
    return m.group(1).decode("utf-8", "replace") if m else None


def install(g, cfg):
    # Everything that needs garm's instance token: reports, the runner's
    # download and registration, its service installed but not started,
    # system info and idle. Returns how to start the service (argv, cwd).
    g.status("installing", "downloading and installing the runner")
    if cfg.get("packages"):
        log("installing %d extra package(s)" % len(cfg["packages"]))
        install_packages(cfg["packages"])
    home = runner_home()
    pw = pwd.getpwnam(RUNNER_USER)
    rdir = os.path.join(home, "actions-runner")
    os.makedirs(rdir, exist_ok=True)
    tool = cfg["tool"]
    tarball = os.path.join(home, "runner-download.tar.gz")
    log("downloading the runner (%s)" % tool.get("filename"))
    download(g, tool, tarball)
    with tarfile.open(tarball) as t:
        if hasattr(tarfile, "data_filter"):
            t.extractall(rdir, filter="data")
        else:
            t.extractall(rdir)
    os.remove(tarball)
    for root, dirs, files in os.walk(rdir):
        for n in dirs + files:
            os.lchown(os.path.join(root, n), pw.pw_uid, pw.pw_gid)
    os.lchown(rdir, pw.pw_uid, pw.pw_gid)
    deps = os.path.join(rdir, "bin", "installdependencies.sh")
    if os.path.exists(deps):
        log("installing the runner's dependencies")
        subprocess.run([deps], cwd=rdir, check=True)
    if os.path.exists(os.path.join(rdir, "env.sh")):
        as_runner(["./env.sh"], rdir)  # .env and .path for the service
    g.status("installing", "configuring the runner")
    if cfg.get("jit"):
        # The runner's own credentials (JIT): they stay, the runner needs
        # them (readable by the runner user only).
        for remote, local in (("credentials/runner", ".runner"), ("credentials/credentials", ".credentials"),
                              ("credentials/credentials_rsaparams", ".credentials_rsaparams")):
            p = os.path.join(rdir, local)
            with open(p, "wb") as f:
                f.write(g.metadata(remote))
            os.chown(p, pw.pw_uid, pw.pw_gid)
            os.chmod(p, 0o600)
        svc = g.metadata("system/service-name").decode().strip()
        if not re.fullmatch(r"[A-Za-z0-9@._-]{1,200}", svc):
            raise RuntimeError("service name from garm refused: %r" % svc[:80])
        unit = g.metadata("systemd/unit-file?runAsUser=" + RUNNER_USER)
        if not svc.endswith(".service"):
            svc += ".service"
        runsvc = os.path.join(rdir, "bin", "runsvc.sh")
        if os.path.exists(runsvc):  # garm's unit runs actions-runner/runsvc.sh
            shutil.copy(runsvc, rdir)
            os.lchown(os.path.join(rdir, "runsvc.sh"), pw.pw_uid, pw.pw_gid)
        with open(os.path.join(ROOT + SYSTEMD_DIR, svc), "wb") as f:
            f.write(unit)
        subprocess.run(["systemctl", "daemon-reload"], check=True)
        # enabled, not started: it starts last (start_runner)
        subprocess.run(["systemctl", "enable", svc], check=True)
        start = (["systemctl", "start", svc], "/")
    else:
        # The registration token is the runner's, not the instance's, and
        # lives in this process and config.sh only; config.sh leaves the
        # runner's own credentials (.runner, .credentials), which stay.
        reg_token = g.metadata("runner-registration-token/").decode().strip()
        args = ["./config.sh", "--unattended", "--url", cfg["repo_url"], "--token", reg_token,
                "--name", cfg["name"], "--labels", ",".join(cfg.get("labels") or []),
                "--no-default-labels", "--ephemeral"]
        if cfg.get("runner_group"):
            args += ["--runnergroup", cfg["runner_group"]]
        as_runner(args, rdir)
        subprocess.run(["./svc.sh", "install", RUNNER_USER], cwd=rdir, check=True)
        start = (["./svc.sh", "start"], rdir)
    agent_id = None
    try:
        with open(os.path.join(rdir, ".runner"), "rb") as f:
            agent_id = json.loads(f.read().decode("utf-8-sig")).get("agentId")
    except (OSError, ValueError):
        pass
    osr = {}
    try:
        with open("/etc/os-release") as f:
            for line in f:
                k, _, v = line.strip().partition("=")
                osr[k] = v.strip('"')
    except OSError:
        pass
    try:  # best effort, as in garm's own bootstrap
        g.request("POST", g.info_url, {"os_name": osr.get("NAME", ""), "os_version": osr.get("VERSION_ID", ""),
                                       "agent_id": agent_id}, g.token)
    except Exception as e:
        log("system info not reported: %s" % e)
    # idle before the service starts: afterwards nothing may hold the
    # token (garm's own bootstrap reports it right after the start).
    g.status("idle", "runner successfully installed", agent_id)
    log("runner installed (agent %s)" % agent_id)
    return start


def main():
    devs = seed_devices()
    raw = seed_params(devs)
    if raw is None:
        log("no parameters on a seed (a later boot): nothing to do")
        return
    token = read_token(raw)
    g = None
    try:
        # The seed goes first: from here on the parameters are in this
        # process's memory only.
        wipe_seeds(devs)
        cfg = json.loads(raw)
        token = cfg.get("token") or token
        for k, v in (cfg.get("proxy") or {}).items():
            if v:
                os.environ[k] = v
                os.environ[k.lower()] = v
        if cfg.get("ca_bundle"):
            subprocess.run(["update-ca-certificates"], check=False)
        g = Garm(cfg)
        start = install(g, cfg)
    except Exception as e:  # report any failure to garm, then stop
        log("failed: %s" % e)
        if g is not None:
            g.status("failed", str(e)[:1000])
        finish(devs, token)
        print(DONE_MARKER, flush=True)
        sys.exit(1)
    except BaseException:
        finish(devs, token)
        print(DONE_MARKER, flush=True)
        raise
    finish(devs, token)
    start_runner(start)

if __name__ == "__main__":
    main()
